"""Skills (`docs/agent.md`, "Skills"): folders of instructions the model reads on demand.

Theory of operation
-------------------
A skill is a folder named after it holding `SKILL.md`: front matter (`name`,
`description`) between `---` lines, then the body, the way Claude Code's skills are
written; other files in the folder are there for the body to point at. The bundled
skills ship in the package (`bmoe/agent/skills/`, or the folder `--skills-dir` names);
a person's are `<data>/skills/<name>/`, and one of theirs hides a bundled one of the
same name. Nothing is cached: every listing reads the folders again (a worker thread),
so a skill edited by hand is seen at once.

A conversation switches skills on by name (its `skills` list). The model then sees each
one's name and description in the system prompt and is offered one tool, `read_skill`:
without `path` it answers the body and the folder's file list, with `path` that file,
resolved inside the skill's folder exactly as a workspace path is (`paths.resolve`).
A skill is created by writing the whole folder under a temporary name, fsyncing it and
renaming it into place, so a half-written skill is never seen and two creations of one
name cannot both win.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import atomicfile
from . import store, tools
from .paths import ToolError, resolve

BUNDLED = Path(__file__).resolve().parent / "skills"
TOOL = "read_skill"
NAME_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?\Z")   # Claude Code's rule
FILE_PART_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
DESCRIPTION_MAX_CHARS = 1024
SKILL_MD_MAX_BYTES = 256 * 1024      # a SKILL.md larger than this is not read
FILES_MAX = 100                      # extra files a created skill may hold
FILES_MAX_BYTES = 4 * 2**20          # their total size
LIST_MAX_FILES = 200                 # files the tool lists of one skill
SKILLS_MAX = 200                     # skills read from one folder


class SkillError(Exception):
    """A skill that cannot be made or used; `message` is a sentence for people."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message, self.code = message, code


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    source: str              # "bundled" or "person"
    folder: Path

    def entry(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "source": self.source,
                "path": str(self.folder)}


# -- SKILL.md (no I/O) --------------------------------------------------------------------

def parse(text: str) -> tuple[dict[str, str], str]:
    """The front matter's `key: value` lines and the body; SkillError when there is none."""
    lines = text.lstrip("\ufeff").split("\n")
    if not lines or lines[0].strip() != "---":
        raise SkillError("SKILL.md must start with front matter between `---` lines.")
    meta: dict[str, str] = {}
    for i, line in enumerate(lines[1:], start=1):
        if line.strip() == "---":
            return meta, "\n".join(lines[i + 1:]).strip("\n")
        key, sep, value = line.partition(":")
        if sep and key.strip() and not line.startswith((" ", "\t", "#")):
            meta[key.strip()] = _unquote(value.strip())
    raise SkillError("SKILL.md's front matter is not closed by a `---` line.")


def _unquote(v: str) -> str:
    if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
        return v[1:-1]
    return v


def render(name: str, description: str, body: str) -> str:
    desc = " ".join(description.split())
    return f"---\nname: {name}\ndescription: {desc}\n---\n\n{body.strip()}\n"


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or "--" in name:
        raise SkillError("A skill's name is 1 to 64 lowercase letters, digits and single "
                         "hyphens, starting and ending with a letter or digit.")
    return name


def check_description(description: object) -> str:
    if not isinstance(description, str) or not description.strip():
        raise SkillError("A skill needs a `description`: one line saying when to use it.")
    if len(description) > DESCRIPTION_MAX_CHARS:
        raise SkillError(f"A skill's description is at most {DESCRIPTION_MAX_CHARS} characters.")
    return " ".join(description.split())


def check_file_name(rel: object) -> str:
    """A relative path inside a skill's folder, made of plain parts (no `..`, no `/` first)."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or not all(FILE_PART_RE.match(p) for p in parts) or parts == ["SKILL.md"]:
        raise SkillError(f"{rel!r} is not a file name a skill may hold: plain names joined "
                         "by /, no `..`, not SKILL.md itself.")
    return "/".join(parts)


# -- the folders ------------------------------------------------------------------------

class SkillStore:
    def __init__(self, data_dir: Path, bundled_dir: Path | None = None) -> None:
        self.person_dir = data_dir / "skills"
        self.bundled_dir = bundled_dir if bundled_dir is not None else BUNDLED

    def scan(self) -> dict[str, Skill]:
        """Every skill by name: the bundled ones, then the person's over them."""
        found = _scan(self.bundled_dir, "bundled")
        found.update(_scan(self.person_dir, "person"))
        return found

    def listing(self) -> list[dict[str, Any]]:
        return [s.entry() for s in sorted(self.scan().values(), key=lambda s: s.name)]

    def detail(self, name: str) -> dict[str, Any]:
        """One skill's entry with its instructions (the body of its SKILL.md) and its
        files, for a person who edits it."""
        check_name(name)
        skill = self.scan().get(name)
        if skill is None:
            raise SkillError(f"There is no skill named {name}.", "not_found")
        _, body = _read_skill_md(skill.folder / "SKILL.md")
        return {**skill.entry(), "body": body, "files": _files(skill.folder)}

    def enabled(self, names: list[str]) -> list[Skill]:
        known = self.scan()
        return [known[n] for n in names if n in known]

    def create(self, name: str, description: str, body: str,
               files: dict[str, str] | None = None) -> Skill:
        check_name(name)
        desc = check_description(description)
        files = {check_file_name(k): v for k, v in (files or {}).items()}
        if len(files) > FILES_MAX or sum(len(v.encode()) for v in files.values()) > FILES_MAX_BYTES:
            raise SkillError(f"A skill holds at most {FILES_MAX} files and "
                             f"{FILES_MAX_BYTES // 2**20} MiB besides SKILL.md.")
        final = self.person_dir / name
        if final.exists() or final.is_symlink():
            raise SkillError(f"You already have a skill named {name}.", "exists")
        self.person_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=self.person_dir))
        try:
            store.write_bytes(tmp / "SKILL.md", render(name, desc, body).encode("utf-8"))
            for rel, text in files.items():
                store.write_bytes(tmp / rel, text.encode("utf-8"))
            os.chmod(tmp, 0o755)
            try:
                os.rename(tmp, final)      # fails when `final` appeared meanwhile
            except OSError:
                raise SkillError(f"You already have a skill named {name}.", "exists") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        atomicfile.fsync_dir(self.person_dir)         # the rename, on disk
        return Skill(name, desc, "person", final)

    def update(self, name: str, description: str | None, body: str | None) -> Skill:
        skill = self._persons(name)
        _, old_body = _read_skill_md(skill.folder / "SKILL.md")
        desc = check_description(description) if description is not None else skill.description
        text = render(name, desc, body if body is not None else old_body)
        store.write_bytes(skill.folder / "SKILL.md", text.encode("utf-8"))
        return Skill(name, desc, "person", skill.folder)

    def delete(self, name: str) -> None:
        skill = self._persons(name)
        gone = skill.folder.with_name(f".{name}.deleted.tmp")
        shutil.rmtree(gone, ignore_errors=True)
        os.rename(skill.folder, gone)              # gone at once, then removed at leisure
        shutil.rmtree(gone, ignore_errors=True)
        atomicfile.fsync_dir(self.person_dir)

    def _persons(self, name: str) -> Skill:
        check_name(name)
        found = _scan(self.person_dir, "person").get(name)
        if found is None:
            what = ("a bundled skill: it cannot be changed here (create one of yours with "
                    "its name to hide it)") if name in _scan(self.bundled_dir, "bundled") \
                else "no skill of yours by that name"
            raise SkillError(f"{name} is {what}.", "not_found")
        return found

    # -- the tool ----------------------------------------------------------------------

    def read_tool(self, names: list[str], args: dict[str, Any]) -> str:
        """`read_skill`: a switched-on skill's body and file list, or one of its files."""
        name = args.get("name")
        skill = next((s for s in self.enabled(names) if s.name == name), None)
        if skill is None:
            on = ", ".join(names) or "none"
            raise ToolError(f"There is no skill named {name!r} here; the skills on are: {on}.")
        path = args.get("path")
        if path in (None, "", "SKILL.md"):
            _, body = _read_skill_md(skill.folder / "SKILL.md")
            listed = _files(skill.folder)
            more = ("\n\nFiles in this skill (read one with `path`):\n" + "\n".join(listed)
                    if listed else "")
            return body + more
        resolve(skill.folder, path)                # confined to the skill's folder
        return tools.read_file(skill.folder, {k: v for k, v in args.items() if k != "name"})


def _scan(folder: Path, source: str) -> dict[str, Skill]:
    out: dict[str, Skill] = {}
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return out
    for e in entries[:SKILLS_MAX * 4]:
        if len(out) >= SKILLS_MAX or not NAME_RE.match(e.name) or not e.is_dir():
            continue
        try:
            meta, _ = _read_skill_md(Path(e.path) / "SKILL.md")
        except (SkillError, OSError):
            continue
        desc = " ".join(meta.get("description", "").split())[:DESCRIPTION_MAX_CHARS]
        if meta.get("name") == e.name and desc:
            out[e.name] = Skill(e.name, desc, source, Path(os.path.realpath(e.path)))
    return out


def _read_skill_md(path: Path) -> tuple[dict[str, str], str]:
    real = resolve(path.parent, "SKILL.md")        # a link out of the folder is not read
    with open(real, "rb") as f:
        data = f.read(SKILL_MD_MAX_BYTES + 1)
    if len(data) > SKILL_MD_MAX_BYTES:
        raise SkillError("SKILL.md is larger than 256 KiB.")
    return parse(data.decode("utf-8", "replace"))


def _files(folder: Path) -> list[str]:
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, fn), folder)
            if rel != "SKILL.md" and not fn.startswith("."):
                out.append(rel)
            if len(out) >= LIST_MAX_FILES:
                return out + [f"(the list stops at {LIST_MAX_FILES} files)"]
    return out


# -- what the model is offered -------------------------------------------------------------

SPEC = tools._fn(TOOL, "Read a skill switched on for this conversation: without path, its "
                 "instructions and the list of its files; with path, one of those files.",
                 {"name": {"type": "string", "description": "the skill's name"},
                  "path": {"type": "string", "description": "a file of the skill, optional"},
                  "offset": {"type": "integer", "description": "first line, from 1"},
                  "limit": {"type": "integer", "description": "number of lines"}}, ["name"])


def system_note(skills: list[Skill]) -> str:
    if not skills:
        return ""
    lines = "\n".join(f"- {s.name}: {s.description}" for s in skills)
    return ("\n\nSkills you can use (read one with the read_skill tool before doing what it "
            f"covers):\n{lines}")

"""A writer for kill -9 trials (tests/test_faults_writing.py): it writes one of the files
the server keeps, through the project's own writer, again and again, and prints
``ack N`` once write N has returned (what the server would then acknowledge to a
client). It starts from what the folder holds (the file a killed run left), so every
trial reads the previous trial's file first.

    python tests/_writer_child.py KIND FOLDER

KIND: conversation, catalog, config, client, skill.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

FILLER = "x" * 3000            # every write is some pages long, as a real conversation is


def say(n: int) -> None:
    sys.stdout.write(f"ack {n}\n")
    sys.stdout.flush()


def conversation(folder: Path) -> None:
    from bmoe.agent import conversation as cv
    from bmoe.agent import store
    path = folder / "conversations" / "c.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    conv: Any = store.read_json(path, None) or cv.new_conversation("t", "chat", None, "local")
    n = int(conv["items"][-1]["text"].split()[1]) + 1 if conv["items"] else 0
    while True:
        conv["items"] = conv["items"][-20:]          # some pages, not a growing file
        conv["items"].append(cv.user_item(f"message {n} {FILLER}"))
        store.write_bytes(path, store.encode(conv))      # AgentService.save's own call
        say(n)
        n += 1


def catalog(folder: Path) -> None:
    from bmoe.models.catalog import AddedEntries, CatalogFile, Entry
    added = AddedEntries(folder)
    n = len(added.entries)
    while True:
        added.put(Entry(f"url:m{n}.gguf", f"model {n} {FILLER[:200]}",
                        [CatalogFile(f"m{n}.gguf", n + 1, f"https://h/m{n}.gguf")], added=True))
        say(n)
        n += 1


def config(folder: Path) -> None:
    from bmoe.runtime.config import ConfigStore
    store = ConfigStore(folder, {})
    n = int(store.state()["values"].get("n-predict") or 0)
    while True:
        n += 1
        store.put({"n-predict": n}, [], peer_is_local=True, model_dirs=[])
        say(n)


def client(folder: Path) -> None:
    from bmoe.agent import clients
    entry = next(e for e in clients.catalog() if e["id"] == "claude-code")
    env = {"CLAUDE_CONFIG_DIR": str(folder), "HOME": str(folder)}
    n = 0
    path = folder / "settings.json"
    if path.exists():
        import json
        url = json.loads(path.read_text())["env"]["ANTHROPIC_BASE_URL"]
        n = int(url.rsplit(":", 1)[1]) - 10000 + 1
    while True:
        clients.connect(entry, clients.Target(f"http://127.0.0.1:{10000 + n}", "m", 4096, None),
                        env)
        say(n)
        n += 1


def skill_b_after(n: int) -> bool:
    """Whether skill-b exists once write n (odd: create or delete it) has returned."""
    return (n // 2) % 2 == 0


def skill(folder: Path) -> None:
    """Even writes change skill-a's SKILL.md (update); odd ones create or delete skill-b
    (a folder made aside and renamed into place, or renamed away and removed)."""
    from bmoe.agent.skills import SkillStore
    skills = SkillStore(folder, bundled_dir=folder / "none")
    n = 0
    if "skill-a" in skills.scan():
        n = int(skills.detail("skill-a")["body"].split()[1]) + 1
        if n % 2 and ("skill-b" in skills.scan()) == skill_b_after(n):
            n += 1                        # write n (skill-b's) was done before the kill
    else:
        skills.create("skill-a", "the one that changes", f"body 0 {FILLER}")
    while True:
        if n % 2 == 0:
            skills.update("skill-a", None, f"body {n} {FILLER}")
        elif skill_b_after(n):
            if "skill-b" not in skills.scan():
                skills.create("skill-b", "comes and goes", f"body {n} {FILLER}")
        elif "skill-b" in skills.scan():
            skills.delete("skill-b")
        say(n)
        n += 1


KINDS = {"conversation": conversation, "catalog": catalog, "config": config,
         "client": client, "skill": skill}

if __name__ == "__main__":
    KINDS[sys.argv[1]](Path(sys.argv[2]))

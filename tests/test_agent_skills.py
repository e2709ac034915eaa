"""Skills (`docs/agent.md`, "Skills"): SKILL.md's front matter, names and paths checked,
the person's folder over the bundled one, and a skill read by the agent: a conversation
with the skill switched on, driven by the scripted provider of `test_agent_e2e`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import ServerProcess
from test_agent_e2e import (Scripted, agent_server, api, kinds, provider,  # noqa: F401
                            setup_conversation, wait_idle, workspace)

from bmoe.agent import skills
from bmoe.agent.paths import ToolError

SKILL_MD = "---\nname: greet\ndescription: Use when asked to greet someone.\n---\n\nSay hello warmly.\n"


def test_front_matter_and_body() -> None:
    meta, body = skills.parse(SKILL_MD)
    assert meta == {"name": "greet", "description": "Use when asked to greet someone."}
    assert body == "Say hello warmly."
    meta, _ = skills.parse('---\nname: "q"\ndescription: \'a: b\'\n---\n')
    assert meta == {"name": "q", "description": "a: b"}
    for bad in ("no front matter", "---\nname: x\n", ""):
        with pytest.raises(skills.SkillError):
            skills.parse(bad)


@pytest.mark.parametrize("name", ["a", "pdf-tools", "x1", "a" * 64])
def test_good_names(name: str) -> None:
    assert skills.check_name(name) == name


@pytest.mark.parametrize("name", ["", "A", "-a", "a-", "a--b", "a" * 65, "../x", "a/b", ".x",
                                  "a b", "é", 3, None])
def test_bad_names(name: object) -> None:
    with pytest.raises(skills.SkillError):
        skills.check_name(name)


@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "a/../../b", "", "SKILL.md", "a//b",
                                 ".hidden", "a/./b"])
def test_file_names_stay_inside(rel: str) -> None:
    with pytest.raises(skills.SkillError):
        skills.check_file_name(rel)


def bundled(tmp_path: Path) -> Path:
    d = tmp_path / "bundled" / "greet"
    d.mkdir(parents=True)
    (d / "SKILL.md").write_text(SKILL_MD)
    (tmp_path / "bundled" / "broken").mkdir()
    (tmp_path / "bundled" / "broken" / "SKILL.md").write_text("no front matter")
    return tmp_path / "bundled"


def test_the_persons_skills_hide_bundled_ones(tmp_path: Path) -> None:
    st = skills.SkillStore(tmp_path / "data", bundled(tmp_path))
    assert [(s["name"], s["source"]) for s in st.listing()] == [("greet", "bundled")]
    st.create("greet", "Mine.", "Say hi.")
    assert [(s["name"], s["source"]) for s in st.listing()] == [("greet", "person")]
    with pytest.raises(skills.SkillError) as e:
        st.create("greet", "Again.", "x")
    assert e.value.code == "exists"
    st.update("greet", None, "Say hi twice.")
    assert "Say hi twice." in st.read_tool(["greet"], {"name": "greet"})
    st.delete("greet")
    assert [(s["name"], s["source"]) for s in st.listing()] == [("greet", "bundled")]
    with pytest.raises(skills.SkillError) as e:
        st.delete("greet")                       # bundled ones are not deleted here
    assert e.value.code == "not_found" and "bundled" in e.value.message
    assert not [p for p in (tmp_path / "data" / "skills").iterdir()]   # no temporaries left


def test_the_tool_reads_only_inside_the_skill(tmp_path: Path) -> None:
    st = skills.SkillStore(tmp_path / "data", tmp_path / "none")
    st.create("docs", "Use for docs.", "Read ref/style.md first.", {"ref/style.md": "Be brief.\n"})
    (tmp_path / "secret.txt").write_text("top secret")
    os.symlink(tmp_path / "secret.txt", tmp_path / "data" / "skills" / "docs" / "link.txt")
    first = st.read_tool(["docs"], {"name": "docs"})
    assert first.startswith("Read ref/style.md first.") and "ref/style.md" in first
    assert "Be brief." in st.read_tool(["docs"], {"name": "docs", "path": "ref/style.md"})
    for bad in ("../../secret.txt", str(tmp_path / "secret.txt"), "link.txt"):
        with pytest.raises(ToolError) as e:
            st.read_tool(["docs"], {"name": "docs", "path": bad})
        assert "top secret" not in e.value.message
    with pytest.raises(ToolError):
        st.read_tool([], {"name": "docs"})           # not switched on in this conversation


def test_the_bundled_skills_parse() -> None:
    listed = skills.SkillStore(Path("/nonexistent"), None).listing()
    assert listed and all(s["source"] == "bundled" and s["description"] for s in listed)


# -- on a real server, through the scripted provider --------------------------------------------

def test_a_skill_is_read_by_the_agent(agent_server: ServerProcess,  # noqa: F811
                                      provider: Scripted, workspace: Path) -> None:  # noqa: F811
    srv = agent_server
    made = {"name": "release-notes", "description": "Use when asked for release notes.",
            "body": "Write them as a bulleted list; see template.md.",
            "files": {"template.md": "- what changed\n- why\n"}}
    status, skill = api(srv, "POST", "/api/skills", made)
    assert status == 201 and skill["source"] == "person", skill
    assert (srv.data_dir / "skills" / "release-notes" / "SKILL.md").is_file()
    status, err = api(srv, "POST", "/api/skills", made)
    assert status == 409 and err["code"] == "exists"
    status, err = api(srv, "POST", "/api/skills", dict(made, name="../up"))
    assert status == 400 and err["code"] == "invalid_request"
    status, err = api(srv, "POST", "/api/skills", dict(made, name="ok", files={"../x": "y"}))
    assert status == 400 and not (srv.data_dir / "x").exists()

    def read(**args: str) -> dict[str, object]:
        return {"call": "read_skill", "args": dict(args, name="release-notes")}

    provider.script = [read(), read(path="template.md"), read(path="../../../etc/passwd"),
                       "- it works"]
    cid = setup_conversation(srv, provider, workspace, "openai", "ask")
    status, err = api(srv, "PUT", f"/api/conversations/{cid}", {"skills": ["nope"]})
    assert status == 400
    status, conv = api(srv, "PUT", f"/api/conversations/{cid}", {"skills": ["release-notes"]})
    assert status == 200 and conv["skills"] == ["release-notes"]
    api(srv, "POST", f"/api/conversations/{cid}/messages", {"text": "Notes, please."})
    conv = wait_idle(srv, cid)
    # read in `ask` mode without an approval: it only reads what the person installed
    assert kinds(conv) == ["user", "assistant", "tool:done", "assistant", "tool:done",
                           "assistant", "tool:failed", "assistant"], conv["items"]
    assert "bulleted list" in conv["items"][2]["output"]
    assert "template.md" in conv["items"][2]["output"]
    assert "- what changed" in conv["items"][4]["output"]
    assert "outside" in conv["items"][6]["output"] and "root:" not in conv["items"][6]["output"]
    first = provider.requests[0]
    assert "read_skill" in json.dumps(first["tools"])
    system = next(m["content"] for m in first["messages"] if m["role"] == "system")
    assert "release-notes: Use when asked for release notes." in system

    status, listing = api(srv, "GET", "/api/skills")
    assert "release-notes" in [s["name"] for s in listing["skills"]]
    status, one = api(srv, "GET", "/api/skills/release-notes")
    assert status == 200 and one["body"].startswith("Write them as a bulleted list")
    assert one["files"] == ["template.md"] and one["source"] == "person"
    assert api(srv, "GET", "/api/skills/no-such-skill")[0] == 404
    assert api(srv, "GET", "/api/skills/..%2Fup")[0] in (400, 404)
    status, _ = api(srv, "PUT", "/api/skills/release-notes", {"description": "Changed."})
    assert status == 200
    status, out = api(srv, "DELETE", "/api/skills/release-notes")
    assert status == 200 and out == {"deleted": True}
    assert not (srv.data_dir / "skills" / "release-notes").exists()
    status, err = api(srv, "DELETE", "/api/skills/release-notes")
    assert status == 404 and err["code"] == "not_found"


def test_a_conversation_without_skills_is_not_offered_the_tool(
        agent_server: ServerProcess, provider: Scripted, workspace: Path) -> None:  # noqa: F811
    provider.script = ["hi"]
    cid = setup_conversation(agent_server, provider, workspace, "openai", "ask")
    api(agent_server, "POST", f"/api/conversations/{cid}/messages", {"text": "hello"})
    wait_idle(agent_server, cid)
    assert "read_skill" not in json.dumps(provider.requests[0]["tools"])

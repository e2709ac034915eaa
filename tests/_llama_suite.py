"""llama.cpp's own server tests, run against bmoe-server.

The pinned llama-cpp-python sdist carries llama.cpp's server test suite
(``vendor/llama.cpp/tools/server/tests``: pytest; each case starts the binary named by
``LLAMA_SERVER_BIN_PATH`` with llama-server's command line and talks to it over HTTP).
This module runs that suite, unchanged, against ``bmoe-server``. The adapter is small and
does three things only, none of which touches a case:

- **the models**: the presets name Hugging Face repositories (``--hf-repo
  ggml-org/test-model-stories260K`` ...). Nothing can be downloaded here, so a local hub
  (`_hub.Hub`, HTTPS) serves those repositories, each holding a model the model maker
  writes (the tiny MoE; a vision pair for ``tinygemma3``), and the server is pointed at
  it with ``--hf-endpoint`` / ``--hf-ca-file`` — the same fetch a real ``--hf-repo``
  start does, then ``--offline`` finds the files;
- **the binary**: ``LLAMA_SERVER_BIN_PATH`` is a two-line shell script that runs
  ``bmoe-server`` with a data folder of the run and the hub's address before the suite's
  own arguments;
- **the warm-up**: the suite's session fixture starts every preset once to fetch its
  files (``ServerPreset.load_all``) and stops the whole session at the first one that does
  not start. A plugin (`_llama_suite_plugin`) lets it go on past a preset that does not
  start, so the cases of that preset fail one by one (each counted) and the rest run.

`run` answers each case's outcome by its node id, read from the suite's JUnit XML.

Usage (by hand): ``python tests/_llama_suite.py [-k EXPR] [FILES...]`` prints every case's
outcome and the totals; ``BMOE_SUITE_SOURCE=DIR`` runs the server from another checkout
(a clean worktree while the tree is being edited), ``BMOE_SUITE_WORK=DIR`` keeps the run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _hub import Hub  # noqa: E402
from _llama_templates import sdist_tarball, vocab_gguf  # noqa: E402

SUITE = "vendor/llama.cpp/tools/server/tests/"
TEMPLATES = "vendor/llama.cpp/models/templates/"

# The repositories the presets of utils.py name, and the file each one holds here.
# ("tiny-moe": the model maker's tiny MoE; "vision": a model and its projector; "bert" and
# "reranker": tiny BERTs with BGE's real WordPiece vocabulary, one with a reranker's head.)
REPOS: dict[str, list[tuple[str, str]]] = {
    "ggml-org/models": [("tinyllamas/stories260K.gguf", "tiny-moe"),
                        ("tinyllamas/split/stories15M-q8_0-00001-of-00003.gguf", "tiny-moe"),
                        ("bert-bge-small/ggml-model-f16.gguf", "bert"),
                        ("jina-reranker-v1-tiny-en/ggml-model-f16.gguf", "reranker")],
    "ggml-org/test-model-stories260K": [("stories260K-Q4_K_M.gguf", "tiny-moe")],
    "ggml-org/test-model-stories260K-infill": [("stories260K-infill-Q4_K_M.gguf", "tiny-moe")],
    "ggml-org/stories15M_MOE": [("stories15M_MOE-F16.gguf", "tiny-moe")],
    "ggml-org/tinygemma3-GGUF": [("tinygemma3-Q8_0.gguf", "vision-model"),
                                 ("mmproj-tinygemma3-F16.gguf", "vision-projector")],
}


def extract(dest: Path) -> Path:
    """The suite's folder, unpacked from the sdist into `dest` (once), where the suite
    expects to be: ``llama.cpp/tools/server/tests``, with the chat templates its cases
    name at ``../../../models/templates`` and its download folder ``tmp``."""
    tree = dest / "llama.cpp"
    root = tree / "tools" / "server" / "tests"
    if (root / "utils.py").is_file():
        return root
    wanted = {SUITE: root, TEMPLATES: tree / "models" / "templates"}
    with tarfile.open(sdist_tarball()) as tar:
        for member in tar.getmembers():
            name = member.name.split("/", 1)[-1]
            for prefix, into in wanted.items():
                if not name.startswith(prefix) or not member.isfile():
                    continue
                rel = Path(name[len(prefix):])
                if ".." in rel.parts or rel.is_absolute():
                    continue
                target = into / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                assert src is not None
                target.write_bytes(src.read())
    (root / "tmp").mkdir(exist_ok=True)
    return root


def make_hub(folder: Path) -> Hub:
    """A local hub serving the presets' repositories (files the model maker writes)."""
    from bmoe.modelmaker import make_model
    from bmoe.modelmaker.bert import make_bert
    from bmoe.modelmaker.projector import make_vision_pair

    models = folder / "models"
    made = {"tiny-moe": make_model(models / "tiny-moe.gguf")}
    made["vision-model"], made["vision-projector"] = make_vision_pair(models / "vision",
                                                                      "tinygemma3")
    vocab = vocab_gguf("bert-bge")
    made["bert"] = make_bert(models / "bert-bge-small.gguf", vocab, name="bert-bge-small")
    made["reranker"] = make_bert(models / "reranker.gguf", vocab, rerank=True,
                                 name="jina-reranker-tiny")
    (folder / "hub").mkdir(parents=True, exist_ok=True)
    hub = Hub(folder / "hub")
    for repo, files in REPOS.items():
        for path, kind in files:
            hub.add_file(repo, path, made[kind])
    return hub


def write_wrapper(folder: Path, hub: Hub, data_dir: Path) -> Path:
    """The script LLAMA_SERVER_BIN_PATH names: bmoe-server with the run's data folder."""
    script = folder / "llama-server"
    source = os.environ.get("BMOE_SUITE_SOURCE") or str(HERE.parent)
    command = ["env", f"PYTHONPATH={source}", sys.executable, "-m", "bmoe.server",
               "--data-dir", str(data_dir), "--hf-endpoint", hub.url, "--hf-ca-file", hub.cert]
    script.write_text("#!/bin/sh\nexec " + " ".join(f"'{c}'" for c in command) + ' "$@"\n')
    script.chmod(0o755)
    return script


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(work: Path, selection: list[str], *, timeout_s: float = 3600.0,
        echo: bool = False) -> dict[str, str]:
    """Run the suite's `selection` (pytest arguments: files, ``-k``) against bmoe-server;
    each case's outcome (passed / failed / error / skipped) by its node id."""
    work.mkdir(parents=True, exist_ok=True)
    suite = extract(work)
    hub = make_hub(work)
    try:
        script = write_wrapper(work, hub, work / "data")
        report = work / "report.xml"
        report.unlink(missing_ok=True)
        env = dict(os.environ, LLAMA_SERVER_BIN_PATH=str(script), PORT=str(_free_port()),
                   LLAMA_CACHE=str(work / "llama-cache"), PYTHONPATH=str(HERE),
                   PYTHONDONTWRITEBYTECODE="1")
        env.pop("PYTEST_ADDOPTS", None)
        cmd = [sys.executable, "-m", "pytest", "-p", "_llama_suite_plugin", "-q",
               "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:randomly",
               f"--junitxml={report}", "--rootdir", str(suite), *selection]
        out = None if echo else subprocess.DEVNULL
        subprocess.run(cmd, cwd=suite, env=env, stdout=out, stderr=out, timeout=timeout_s,
                       check=False)
        return outcomes(report)
    finally:
        hub.close()


def outcomes(report: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        node = f"{module}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[node] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                       else "skipped" if "skipped" in kinds else "passed")
    return found


def main(argv: list[str]) -> int:
    import tempfile
    work = Path(os.environ.get("BMOE_SUITE_WORK") or tempfile.mkdtemp(prefix="llama-suite-"))
    result = run(work, argv or ["unit"], echo=True)
    for node, outcome in sorted(result.items()):
        print(f"{outcome:8} {node}")
    totals: dict[str, int] = {}
    for outcome in result.values():
        totals[outcome] = totals.get(outcome, 0) + 1
    print(" ".join(f"{k} {v}" for k, v in sorted(totals.items())), f"(work: {work})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

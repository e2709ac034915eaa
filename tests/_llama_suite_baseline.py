"""The baseline of `_llama_suite`: llama-server itself, on the same model files.

Which of llama.cpp's server tests can pass on the tiny model the suite runs here is a
question for llama-server, not for us: many cases assert the text of the model their
presets name (stories260K's "Lily", its token counts), which no other model writes.
This runs the same suite, with the same presets, against the real `llama-server` built
from the pinned sdist's own llama.cpp, on the model files `_llama_suite.make_hub` serves,
and prints each case's outcome. `_llama_suite_expected.BASELINE_PASSED` is its output:
the cases bmoe-server must pass too.

The build (CPU only, 5-15 minutes on two cores), from the unpacked sdist:

    cmake -S vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
          -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \\
          -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    cmake --build build --target llama-server -j2

Then ``python tests/_llama_suite_baseline.py build/bin/llama-server [pytest args]``.
llama-server is started through a small wrapper that turns the presets' ``--hf-repo`` /
``--hf-file`` into ``-m`` (and the projector for tinygemma3): this build fetches
nothing, and the files are the ones the bmoe run fetches from its local hub.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _llama_suite  # noqa: E402


def write_wrapper(folder: Path, binary: Path, files: dict[str, Path]) -> Path:
    """A `llama-server` that maps the presets' repositories onto local files."""
    table = {f"{repo}\t{path}": str(files[kind]) for repo, entries in _llama_suite.REPOS.items()
             for path, kind in entries}
    script = folder / "llama-server"
    script.write_text(f"""#!{sys.executable}
import os, sys
TABLE = {json.dumps(table)}
PROJECTOR = {json.dumps(str(files["vision-projector"]))}
out, repo, file, args, i = [], None, None, sys.argv[1:], 0
while i < len(args):
    if args[i] in ("--hf-repo", "--hf-file"):
        repo, file = (args[i + 1], file) if args[i] == "--hf-repo" else (repo, args[i + 1])
        i += 2
    elif args[i] == "--offline":
        i += 1
    else:
        out.append(args[i]); i += 1
if repo:
    name = repo.split(":")[0]
    hits = [v for k, v in TABLE.items() if k.split("\\t")[0] == name
            and (file is None or k.split("\\t")[1] == file)]
    if not hits:
        sys.exit(f"baseline: no local file for {{repo}} {{file}}")
    out += ["-m", hits[0]]
    if hits[0] != PROJECTOR and "tinygemma3" in name and "--no-mmproj" not in out:
        out += ["--mmproj", PROJECTOR]
os.execv({json.dumps(str(binary))}, [{json.dumps(str(binary))}, *out])
""")
    script.chmod(0o755)
    return script


def run(binary: Path, work: Path, selection: list[str]) -> dict[str, str]:
    suite = _llama_suite.extract(work)
    hub = _llama_suite.make_hub(work)          # the same files (the hub is not used)
    hub.close()
    models = work / "models"
    files = {"tiny-moe": models / "tiny-moe.gguf",
             "vision-model": models / "vision" / "tinygemma3.gguf",
             "vision-projector": models / "vision" / "mmproj-tinygemma3.gguf",
             "bert": models / "bert-bge-small.gguf", "reranker": models / "reranker.gguf"}
    script = write_wrapper(work, binary.resolve(), files)
    report = work / "baseline.xml"
    env = dict(os.environ, LLAMA_SERVER_BIN_PATH=str(script), PORT=str(_llama_suite._free_port()),
               LLAMA_CACHE=str(work / "llama-cache"), PYTHONPATH=str(HERE))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "_llama_suite_plugin",
                    "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={report}",
                    "--rootdir", str(suite), *(selection or ["unit"])], cwd=suite, env=env,
                   check=False)
    return _llama_suite.outcomes(report)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    work = Path(os.environ.get("BMOE_SUITE_WORK") or tempfile.mkdtemp(prefix="llama-base-"))
    result = run(Path(argv[0]), work, argv[1:])
    for node, outcome in sorted(result.items()):
        print(f"{outcome:8} {node}")
    print(sum(o == "passed" for o in result.values()), "passed of", len(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""llama-server's command line starts bmoe-server: every flag llama.cpp's own server tests
pass, what each does here, and the same through `--config` and `LLAMA_ARG_*`.

The flags are the ones `ServerProcess.start()` can put on a command line in llama.cpp's
`tools/server/tests/utils.py` (the copy in the llama-cpp-python 0.3.36 sdist);
`test_the_list_is_the_sdists` checks the list below against that file, read from the
sdist (fetched from PyPI into the cache by `_llama_templates`). What a flag does is written from
llama.cpp's `common/arg.cpp` and `tools/server/server-context.cpp`, not from our output.
The engine's side is read back from llama.cpp itself: `llama_n_batch`/`llama_n_ubatch` of
the context, its KV cache's own size line (K and V types) and its flash-attention line,
reported in `/api/info` `model.context`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from _hub import Hub
from _llama_templates import sdist_text
from conftest import ServerProcess, start_server

from bmoe.engine import params
from bmoe.modelmaker import make_model
from bmoe.server import llama_flags
from bmoe.server.llama_compat import check_flags, config_argv
from bmoe.server.main import build_parser

# Every flag utils.py's ServerProcess.start() can pass, with a value its presets or tests
# give (a switch: None). The model's own flags (-m, --hf-*, URLs) are tested apart.
UTILS_FLAGS: dict[str, str | None] = {
    "--port": "0", "--temp": "0.8", "--seed": "42", "--host": "127.0.0.1",
    "--offline": None, "--model": "MODEL", "--model-url": "URL", "--model-draft": "DRAFT",
    "--hf-repo": "REPO", "--hf-file": "FILE", "--models-dir": "MODELS",
    "--models-max": "2", "--models-preset": "PRESET", "--cors-origins": "http://a.example",
    "--batch-size": "32", "--ubatch-size": "16", "--threads": "1", "--n-gpu-layers": "99",
    "--cont-batching": None, "--embedding": None, "--reranking": None, "--metrics": None,
    "--kv-unified": None, "--swa-full": None, "--slots": None, "--no-slots": None,
    "--pooling": "mean", "--alias": "tinyllama-2", "--tags": "a,b", "--ctx-size": "512",
    "--parallel": "2", "-ctk": "q8_0", "-ctv": "q8_0", "-fa": "on", "--n-predict": "64",
    "--slot-save-path": "SLOTS", "--grp-attn-n": "2", "--grp-attn-w": "512",
    "--verbose": None, "--lora": "LORA", "--context-shift": None,
    "--spec-type": "ngram-simple", "--api-key": "KEY", "--spec-draft-n-max": "4",
    "--spec-draft-n-min": "1", "--spec-synth-len": "2.5", "--spec-synth-rates": "0.9,0.5",
    "--no-ui": None, "--no-models-autoload": None, "--jinja": None, "--no-jinja": None,
    "--reasoning-format": "deepseek", "--reasoning": "off", "--chat-template": "chatml",
    "--chat-template-file": "TEMPLATE", "--mmproj-url": "URL", "--no-mmproj": None,
    "--media-path": "MEDIA", "--sleep-idle-seconds": "10", "--cache-ram": "0",
    "--no-cache-idle-slots": None, "--ui-mcp-proxy": None, "--tools": "all",
    "--tools-runtime": "docker:img", "--mcp-servers-config": "MCP",
    "--mcp-servers-json": "{}", "--backend_sampling": None,
}
# Refused by name, with the reason (a word of it): the rest start the server.
REFUSED = {"--lora": "LoRA",
           "--grp-attn-n": "self-extend", "--grp-attn-w": "self-extend",
           "--models-preset": "router"}
# The model's own flags: they name a file (each started with a real one below).
MODEL_FLAGS = ("--model", "--model-url", "--hf-repo", "--hf-file", "--mmproj-url")


def env_argv(argv: list[str], environ: dict[str, str]) -> tuple[list[str], list[str]]:
    """llama-server's variables read in with bmoe-server's own parser, as a start reads them."""
    return llama_flags.env_argv(argv, environ, build_parser())


def test_the_list_is_the_sdists() -> None:
    text = sdist_text("vendor/llama.cpp/tools/server/tests/utils.py")
    start = text[text.index("    def start("):text.index("        args = [str(arg)")]
    found = set(re.findall(r'"(--?[a-zA-Z][\w-]*)"', start))
    assert found == set(UTILS_FLAGS), (sorted(found - set(UTILS_FLAGS)),
                                       sorted(set(UTILS_FLAGS) - found))


def _parse(argv: list[str]) -> tuple[Any, list[str]]:
    parser = build_parser()
    args = parser.parse_args(llama_flags.respell(argv, parser))
    return args, check_flags(args)


def _argv(flag: str, value: str | None, tmp: Path) -> list[str]:
    if value is None:
        return [flag]
    files = {"MODEL": "m.gguf", "DRAFT": "d.gguf", "MODELS": str(tmp), "SLOTS": str(tmp),
             "LORA": "l.gguf", "TEMPLATE": str(tmp / "t.jinja"), "MEDIA": str(tmp),
             "MCP": str(tmp / "mcp.json"), "PRESET": str(tmp / "p.ini"),
             "URL": "https://example.com/m.gguf", "REPO": "o/r", "FILE": "m.gguf"}
    return [flag, files.get(value, value)]


@pytest.mark.parametrize("flag", sorted(UTILS_FLAGS))
def test_every_flag_of_the_test_suite_is_taken_or_refused_by_name(flag: str,
                                                                    tmp_path: Path) -> None:
    argv = _argv(flag, UTILS_FLAGS[flag], tmp_path)
    if flag == "--hf-file":
        argv = ["--hf-repo", "o/r", *argv]
    if flag in REFUSED:
        with pytest.raises(SystemExit) as refused:
            _parse(argv)
        message = str(refused.value)
        assert flag.lstrip("-").split("-")[0] in message and "refused" in message, message
        assert REFUSED[flag] in message, message
        return
    args, lines = _parse(argv)
    assert all(line and line.endswith(".") for line in lines), lines


def test_hardware_flags_give_one_line() -> None:
    _, lines = _parse(["-ngl", "99", "-dev", "none", "-sm", "layer", "-mg", "0", "-ts", "3,1"])
    hardware = [line for line in lines if "runs on the CPU" in line]
    assert len(hardware) == 1 and all(f in hardware[0] for f in ("-ngl 99", "-dev none",
                                                                   "-sm layer", "-mg 0",
                                                                   "-ts 3,1")), lines


def test_flags_that_stand_for_others() -> None:
    args, lines = _parse(["--reasoning", "off", "--cors-origins", "http://a.example,localhost",
                          "--models-autoload", "--parallel", "4", "--no-jinja"])
    assert args.think is False and args.autoload is True
    assert args.allow_origin == ["http://a.example"]
    text = "\n".join(lines)
    assert "--parallel 4: 4 slots, the whole context each; this server serves one turn at " \
        "a time" in text                      # no -c given: nothing to split
    assert "--no-jinja" in text and "Jinja" in text
    args, _ = _parse(["--reasoning", "on", "--no-think"])          # the table's flag wins
    assert args.think is False
    for argv, why in ((["--parallel", "0"], "--parallel 0"), (["--reasoning", "x"], "on, off"),
                      (["--cors-origins", "*"], "every web page"),
                      (["--reasoning-format", "nothink"], "not one of")):
        with pytest.raises(SystemExit, match=re.escape(why)):
            _parse(argv)


def test_underscores_read_as_dashes() -> None:
    parser = build_parser()
    assert llama_flags.respell(["--backend_sampling", "--ctx_size=8", "--model", "a_b.gguf",
                                "--data_dir"], parser) == \
        ["--backend-sampling", "--ctx-size=8", "--model", "a_b.gguf", "--data-dir"]


# -- the parameter table's new rows --------------------------------------------------

@pytest.mark.parametrize(("flag", "raw", "key", "value"), [
    ("-b", "32", "batch-size", 32), ("--batch-size", "2048", "batch-size", 2048),
    ("-ub", "16", "ubatch-size", 16), ("-fa", "on", "flash-attn", "on"),
    ("-fa", "enabled", "flash-attn", "on"), ("--flash-attn", "0", "flash-attn", "off"),
    ("-fa", "-1", "flash-attn", "auto"), ("-ctk", "q8_0", "cache-type-k", "q8_0"),
    ("-ctv", "iq4_nl", "cache-type-v", "iq4_nl"), ("--cache-type-k", "bf16", "cache-type-k", "bf16"),
    ("--repack", "false", "repack", "off"), ("-mm", "p.gguf", "mmproj", "p.gguf"),
])
def test_table_flags(flag: str, raw: str, key: str, value: Any) -> None:
    args, _ = _parse([f"{flag}={raw}"] if raw.startswith("-") else [flag, raw])
    assert params.values_from_namespace(args)[key] == value


def test_table_switches_and_bounds() -> None:
    args, _ = _parse(["--swa-full", "--no-mmproj"])
    assert params.values_from_namespace(args) == {"swa-full": True, "mmproj-auto": False}
    for argv, why in ((["-ub", "0"], "between 1 and 16384"),
                      (["-b", "16385"], "between 1 and 16384"),
                      (["-ctk", "q3_k"], "one of f16, f32, bf16, q8_0"),
                      (["-fa", "maybe"], "one of auto, on, off")):
        with pytest.raises(SystemExit):
            _parse(argv)
        parser = build_parser()
        parser.exit_on_error = False
        with pytest.raises(Exception, match=re.escape(why)):
            parser.parse_args(argv)


def test_quantized_v_needs_flash_attention() -> None:
    message = params.validate({"cache-type-v": "q4_0", "flash-attn": "off"})
    assert params.render(message, "flag").startswith(
        "--cache-type-v q4_0 needs --flash-attn on or auto")
    assert params.render(message) .startswith("KV cache: V type q4_0 needs Flash attention")
    for ok in ({"cache-type-v": "q4_0", "flash-attn": "auto"},
               {"cache-type-v": "bf16", "flash-attn": "off"},
               {"cache-type-k": "q4_0", "flash-attn": "off"}):
        assert params.validate(ok) == "", ok


# -- LLAMA_ARG_* and --config -------------------------------------------------------

def test_variables_of_the_new_flags() -> None:
    env = {"LLAMA_ARG_BATCH": "64", "LLAMA_ARG_UBATCH": "32", "LLAMA_ARG_FLASH_ATTN": "enabled",
           "LLAMA_ARG_CACHE_TYPE_K": "q8_0", "LLAMA_ARG_CACHE_TYPE_V": "q8_0",
           "LLAMA_ARG_SWA_FULL": "1", "LLAMA_ARG_ALIAS": "a,b", "LLAMA_ARG_ENDPOINT_SLOTS": "0",
           "LLAMA_ARG_UI": "off", "LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_JINJA": "true",
           "LLAMA_ARG_THINK": "none", "LLAMA_ARG_MMPROJ_AUTO": "0",
           "LLAMA_ARG_EMBEDDINGS": "0", "LLAMA_ARG_N_GPU_LAYERS": "99"}
    argv, lines = env_argv([], env)
    args, _ = _parse(argv)
    values = params.values_from_namespace(args)
    assert values == {"batch-size": 64, "ubatch-size": 32, "flash-attn": "on",
                      "cache-type-k": "q8_0", "cache-type-v": "q8_0", "swa-full": True,
                      "mmproj-auto": False, "embedding": False}
    F, given = llama_flags.BY_LONG, llama_flags.given
    assert given(args, F["--alias"]) == ["a,b"] and given(args, F["--slots"]) is False
    assert given(args, F["--webui"]) is False and given(args, F["--parallel"]) == "2"
    assert given(args, F["--reasoning-format"]) == "none" and given(args, F["--jinja"])
    text = "\n".join(lines)
    assert "LLAMA_ARG_ENDPOINT_SLOTS read as --no-slots." in text
    assert "LLAMA_ARG_N_GPU_LAYERS read as --n-gpu-layers 99." in text
    with pytest.raises(SystemExit, match="LLAMA_ARG_SWA_FULL='maybe' is neither on nor off"):
        env_argv([], {"LLAMA_ARG_SWA_FULL": "maybe"})
    on, _ = _parse(env_argv([], {"LLAMA_ARG_EMBEDDINGS": "1", "LLAMA_ARG_POOLING": "mean"})[0])
    assert params.values_from_namespace(on) == {"embedding": True, "pooling": "mean"}
    rerank, _ = _parse(["--reranking"])         # --reranking stands for these two
    assert params.values_from_namespace(rerank) == {"embedding": True, "pooling": "rank"}


def test_a_flag_replaces_its_variable_in_any_spelling() -> None:
    argv, lines = env_argv(["-ub", "8", "--slots", "-a", "x"],
                           {"LLAMA_ARG_UBATCH": "64", "LLAMA_ARG_ENDPOINT_SLOTS": "0",
                            "LLAMA_ARG_ALIAS": "y"})
    assert argv == ["-ub", "8", "--slots", "-a", "x"]
    assert sum("replaced by the command line" in line for line in lines) == 3


def test_config_keys_are_the_long_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"batch-size": 64, "ubatch-size": 32, "flash-attn": "on",
                               "cache-type-k": "q8_0", "cache-type-v": "q8_0", "alias": ["a", "b"],
                               "no-slots": True, "no-ui": True, "parallel": -1,
                               "n-gpu-layers": 99, "swa-full": True}))
    parser = build_parser()
    argv, lines = config_argv(["--config", str(cfg), "-ub", "8"], parser)
    args, _ = _parse(argv)
    assert params.values_from_namespace(args) == {
        "batch-size": 64, "ubatch-size": 8, "flash-attn": "on", "cache-type-k": "q8_0",
        "cache-type-v": "q8_0", "swa-full": True}
    F, given = llama_flags.BY_LONG, llama_flags.given
    assert llama_flags.split_names(given(args, F["--alias"])) == ("a", "b")
    assert given(args, F["--parallel"]) == "-1" and given(args, F["--slots"]) is False
    assert any("ubatch-size is replaced by the command line's --ubatch-size" in line
               for line in lines)


# -- real servers --------------------------------------------------------------------

@pytest.fixture(scope="module")
def model32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny MoE with heads of 32 (a quantized KV cache needs a multiple of 32)."""
    return make_model(tmp_path_factory.mktemp("m32") / "tiny32.gguf", head_dim=32)


def _start(tmp: Path, *args: str, env: dict[str, str] | None = None) -> tuple[ServerProcess, Path]:
    """A server whose stderr is kept in a file (the lines at start are the test's)."""
    tmp.mkdir(parents=True, exist_ok=True)
    err = tmp / "stderr.txt"
    with err.open("w") as f:
        srv = _with_stderr(f, tmp / "data", *args, env=env)
    return srv, err


def _with_stderr(f: Any, data: Path, *args: str, env: dict[str, str] | None) -> ServerProcess:
    cmd = [sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir", str(data),
           "--no-auto", "--threads", "1", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.wait(30)
        raise AssertionError(f"bmoe-server did not start: {line!r}")
    srv = ServerProcess(proc, line.split("listening on", 1)[1].strip(), data)
    srv.wait_state("ready", "error")
    return srv


def _refused(tmp: Path, *args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-m", "bmoe.server", "--port", "0", "--data-dir",
                          str(tmp), *args], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **(env or {})))
    assert out.returncode != 0 and "listening on" not in out.stdout, out
    return out.stderr


ACCEPTED_LINE = [  # utils.py's flags that start a server, as one command line
    "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1", "--offline",
    "--batch-size", "32", "--ubatch-size", "16", "--n-gpu-layers", "99", "--cont-batching",
    "--metrics", "--kv-unified", "--swa-full", "--no-slots", "--pooling", "mean",
    "--alias", "tinyllama-2", "--tags", "a,b", "--ctx-size", "512", "--parallel", "2",
    "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "--n-predict", "64", "--verbose",
    "--context-shift", "--spec-type", "ngram-simple", "--spec-draft-n-max", "4",
    "--spec-draft-n-min", "1", "--spec-synth-len", "2.5", "--spec-synth-rates", "0.9,0.5",
    "--no-ui", "--no-models-autoload", "--jinja", "--reasoning-format", "deepseek",
    "--reasoning", "off", "--chat-template", "chatml", "--no-mmproj", "--sleep-idle-seconds",
    "3600", "--cache-ram", "0", "--no-cache-idle-slots", "--ui-mcp-proxy", "--tools", "all",
    "--tools-runtime", "docker:img", "--mcp-servers-json", "{}", "--backend_sampling",
    "--models-max", "2", "--cors-origins", "http://a.example", "--model-draft", "d.gguf"]


FIXTURE_FLAGS = ("--model", "--models-dir", "--slot-save-path", "--media-path",
                 "--chat-template-file", "--mcp-servers-config")


@pytest.fixture(scope="module")
def everything(tmp_path_factory: pytest.TempPathFactory,
               model32: Path) -> Iterator[tuple[ServerProcess, str]]:
    tmp = tmp_path_factory.mktemp("everything")
    template = tmp / "t.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                        "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    mcp = tmp / "mcp.json"
    mcp.write_text('{"mcpServers": {}}')
    srv, err = _start(tmp, *ACCEPTED_LINE, "--model", str(model32), "--models-dir",
                      str(tmp / "models"), "--slot-save-path", str(tmp), "--media-path",
                      str(tmp), "--chat-template-file", str(template),
                      "--mcp-servers-config", str(mcp))
    try:
        yield srv, err.read_text()
    finally:
        srv.stop()


def test_the_whole_command_line_starts(everything: tuple[ServerProcess, str]) -> None:
    srv, err = everything
    info = srv.info()
    assert info["state"] == "ready", (info, err)
    given = {a for a in ACCEPTED_LINE if a.startswith("-")} | set(FIXTURE_FLAGS)
    elsewhere = {"--port", "--threads",        # every test server's own
                 "--slots", "--no-jinja",      # test_reasoning_format_reaches_the_chat_route
                 "--api-key",                  # tests/test_llama_compat.py's keyed server
                 "--embedding", "--reranking"}  # tests/test_embeddings.py's BERTs
    assert set(UTILS_FLAGS) - set(REFUSED) - set(MODEL_FLAGS) - elsewhere <= given
    lines = [line for line in err.splitlines() if line.startswith("bmoe-server: ")]
    assert any("this build runs on the CPU, so -ngl 99 has no effect." in line for line in lines)
    assert any(line.startswith("bmoe-server: --parallel 2: 2 slots, the whole context each; "
                               "this server serves one turn at a time")     # --kv-unified
               for line in lines), err
    assert sum("speculative decoding is not built" in line for line in lines) == 1
    assert not any("--cache-ram" in line for line in lines)          # 0 is what we do


def test_the_engine_takes_batch_cache_and_attention(everything: tuple[ServerProcess, str]) -> None:
    srv, _ = everything
    model = srv.info()["model"]
    assert model["n_ctx"] == 512
    # llama.cpp's own: llama_n_batch / llama_n_ubatch, its KV cache's size line, its
    # flash-attention resolution
    assert model["context"] == {"n_batch": 32, "n_ubatch": 16, "flash_attn": "on",
                                "flash_attn_used": True, "cache_type_k": "q8_0",
                                "cache_type_v": "q8_0", "swa_full": True,
                                "kv_reported": True}
    status, _, body = srv.request("POST", "/completion",
                                  {"prompt": "Once upon a time " * 20, "n_predict": 4})
    assert status == 200 and body["tokens_evaluated"] > 32, body   # several prompt batches
    config = srv.request("GET", "/api/config")[2]["values"]
    assert config["think"] is False                                   # --reasoning off


def test_alias_no_ui_and_no_slots(everything: tuple[ServerProcess, str]) -> None:
    srv, _ = everything
    status, _, listed = srv.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in listed["data"]] == ["tinyllama-2"]
    assert listed["data"][0]["aliases"] == ["tinyllama-2"] and listed["data"][0]["tags"] == ["a", "b"]
    assert srv.request("GET", "/v1/models/tinyllama-2")[0] == 200
    status, _, props = srv.request("GET", "/props")
    assert props["model_alias"] == "tinyllama-2" and props["total_slots"] == 2
    assert props["endpoint_slots"] is False and props["ui"] is False
    assert props["endpoint_metrics"] is True
    sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    answer = sdk.chat.completions.create(model="anything", max_tokens=3,
                                         messages=[{"role": "user", "content": "Hi"}])
    assert answer.model == "tinyllama-2"
    done = sdk.completions.create(model="x", prompt="Hello", max_tokens=2)
    assert done.model == "tinyllama-2"
    assert srv.request("POST", "/completion", {"prompt": "Hi", "n_predict": 1})[2]["model"] \
        == "tinyllama-2"
    for path in ("/", "/index.html"):
        assert srv.request("GET", path)[0] == 404, path                # --no-ui
    status, _, body = srv.request("GET", "/slots")
    assert status == 501 and body == {"error": {
        "code": 501, "type": "not_supported_error",
        "message": "This server does not support slots endpoint. Start it with `--slots`"}}


def test_without_the_flags_ui_slots_and_name_are_the_defaults(server: ServerProcess,
                                                             tiny_moe: Path) -> None:
    assert server.request("GET", "/")[0] == 200
    assert server.request("GET", "/slots")[0] == 200
    listed = server.request("GET", "/v1/models")[2]["data"]
    assert listed[0]["id"] == tiny_moe.name and listed[0]["aliases"] == []
    assert server.info()["model"]["context"] == {
        "n_batch": 512, "n_ubatch": 512, "flash_attn": "auto", "flash_attn_used": True,
        "cache_type_k": "f16", "cache_type_v": "f16", "swa_full": False, "kv_reported": True}


def test_the_same_through_config_and_variables(tmp_path: Path, model32: Path) -> None:
    want = {"n_batch": 64, "n_ubatch": 8, "flash_attn": "off", "flash_attn_used": False,
            "cache_type_k": "q4_0", "cache_type_v": "bf16", "swa_full": False,
            "kv_reported": True}
    cfg = tmp_path / "server.json"
    cfg.write_text(json.dumps({"model": str(model32), "ctx-size": 256, "batch-size": 64,
                               "ubatch-size": 8, "flash-attn": "off", "cache-type-k": "q4_0",
                               "cache-type-v": "bf16", "alias": "from-file", "no-ui": True}))
    srv, _ = _start(tmp_path / "a", "--config", str(cfg))
    try:
        assert srv.info()["model"]["context"] == want, srv.info()
        assert srv.request("GET", "/v1/models")[2]["data"][0]["id"] == "from-file"
        assert srv.request("GET", "/")[0] == 404
    finally:
        srv.stop()
    env = {"LLAMA_ARG_MODEL": str(model32), "LLAMA_ARG_CTX_SIZE": "256",
           "LLAMA_ARG_BATCH": "64", "LLAMA_ARG_UBATCH": "8", "LLAMA_ARG_FLASH_ATTN": "off",
           "LLAMA_ARG_CACHE_TYPE_K": "q4_0", "LLAMA_ARG_CACHE_TYPE_V": "bf16",
           "LLAMA_ARG_ALIAS": "from-env", "LLAMA_ARG_ENDPOINT_SLOTS": "false"}
    srv, err = _start(tmp_path / "b", env=env)
    try:
        assert srv.info()["model"]["context"] == want, (srv.info(), err.read_text())
        assert srv.request("GET", "/v1/models")[2]["data"][0]["id"] == "from-env"
        assert srv.request("GET", "/slots")[0] == 501
    finally:
        srv.stop()
    assert "LLAMA_ARG_CACHE_TYPE_K read as --cache-type-k q4_0." in err.read_text()


def test_refused_combinations_say_why(tmp_path: Path, tiny_moe: Path, model32: Path) -> None:
    said = _refused(tmp_path / "a", "-m", str(model32), "-ctv", "q8_0", "-fa", "off")
    assert "--cache-type-v q8_0 needs --flash-attn on or auto" in said, said
    said = _refused(tmp_path / "b", "-m", str(model32),
                    env={"LLAMA_ARG_CACHE_TYPE_V": "q4_0", "LLAMA_ARG_FLASH_ATTN": "off"})
    assert "--cache-type-v q4_0 needs --flash-attn on or auto" in said, said
    said = _refused(tmp_path / "c", "-m", str(model32), "--lora", "x.gguf")
    assert "--lora" in said and "is refused" in said and "no LoRA" in said, said
    # the model's heads (16) are no multiple of q8_0's block (32): llama.cpp's own reason
    srv, _ = _start(tmp_path / "d", "-m", str(tiny_moe), "-c", "256", "-ctk", "q8_0")
    try:
        info = srv.info()
        assert info["state"] == "error", info
        assert "K cache type q8_0 with block size 32 does not divide n_embd_head_k=16" in \
            info["error"] and "KV cache: K type" in info["error"], info["error"]
        put = srv.request("PUT", "/api/config", {"values": {"cache-type-k": "f16",
                                                            "cache-type-v": "q8_0",
                                                            "flash-attn": "off"}})[2]
        assert put["valid"] is False and "Flash attention" in put["error"], put
        assert srv.request("POST", "/api/session/load", {})[0] == 400
    finally:
        srv.stop()


# -- the model by its origin: --hf-repo, --hf-file, --model-url ----------------------

REPO = "ggml-org/test-model-stories260K"


VISION = "ggml-org/tiny-vision-GGUF"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, model32: Path) -> Iterator[Hub]:
    from bmoe.modelmaker.projector import make_vision_pair
    folder = tmp_path_factory.mktemp("hub")
    h = Hub(folder)
    h.add_file(REPO, "stories-Q8_0.gguf", model32)
    h.add_file(REPO, "sub/stories-Q4_K_M.gguf", model32)
    model, projector = make_vision_pair(folder / "vision", "tiny-vision")
    h.add_file(VISION, "tiny-vision-Q4_K_M.gguf", model)
    h.add_file(VISION, "mmproj-tiny-vision-F16.gguf", projector)
    try:
        yield h
    finally:
        h.close()


def test_hf_repo_fetches_once_then_offline_finds_it(tmp_path: Path, hub: Hub) -> None:
    site = ["--hf-endpoint", hub.url, "--hf-ca-file", hub.cert, "-c", "256"]
    data = tmp_path / "data"
    srv = start_server(data, *site, "--hf-repo", REPO, "--alias", "tinyllama-2")
    try:
        info = srv.info()
        assert info["state"] == "ready", info
        assert info["model"]["name"] == "stories-Q4_K_M.gguf"     # llama-server's default quant
        assert Path(info["model"]["path"]).parent == data / "models"
    finally:
        srv.stop()
    hub.clear()
    srv = start_server(data, *site, "--hf-repo", REPO, "--offline")
    try:
        assert srv.info()["model"]["name"] == "stories-Q4_K_M.gguf"
        assert hub.requests == []                                   # nothing asked of the site
    finally:
        srv.stop()
    srv = start_server(data, *site, "-hf", f"{REPO}:Q8_0")
    try:
        assert srv.info()["model"]["name"] == "stories-Q8_0.gguf"
    finally:
        srv.stop()
    said = _refused(tmp_path / "x", *site, "--hf-repo", f"{REPO}:Q2_K")
    assert "has no Q2_K model" in said and "Q4_K_M" in said, said
    said = _refused(tmp_path / "y", *site, "--hf-repo", "ggml-org/other", "--offline")
    assert "--offline fetches nothing" in said, said


def test_hf_file_in_the_models_folder_needs_no_site(tmp_path: Path, model32: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "stories260K.gguf").write_bytes(model32.read_bytes())
    srv = start_server(tmp_path / "data", "--models-dir", str(models), "-c", "256",
                       "--hf-repo", "ggml-org/models", "--hf-file", "tinyllamas/stories260K.gguf",
                       "--hf-endpoint", "https://127.0.0.1:9")    # nothing answers there
    try:
        assert srv.info()["model"]["path"] == str(models / "stories260K.gguf"), srv.info()
    finally:
        srv.stop()
    said = _refused(tmp_path / "z", "-m", str(model32), "--hf-repo", REPO)
    assert "both name the model" in said, said


# -- --reasoning-format: where a thinking model's reasoning goes (sans-I/O) -----------

THOUGHT = "<think>\nLet me see.\n</think>\n\nHello there."
TOOL = {"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}


def _read(fmt: str, text: str, tools: list[Any] | None = None,
          starts_in_reasoning: bool = False) -> Any:
    from bmoe.engine.turn import Prepared, TurnRequest
    from bmoe.runtime.turnevents import TurnOutput
    prepared = Prepared("", [], starts_in_reasoning, "hermes" if tools else None, None, 0)
    out = TurnOutput(prepared, TurnRequest(messages=[], tools=tools), "revisable",
                     reasoning_format=fmt)
    for i in range(0, len(text), 3):                  # streamed in small pieces
        out.feed(text[i:i + 3], 1)
    out.finish()
    return out.view


@pytest.mark.parametrize("fmt", ["auto", "deepseek"])
def test_reasoning_parsed_by_default(fmt: str) -> None:
    view = _read(fmt, THOUGHT)
    assert (view.reasoning, view.content) == ("Let me see.", "Hello there.")


def test_reasoning_format_none_leaves_it_in_the_content() -> None:
    view = _read("none", THOUGHT)
    assert (view.reasoning, view.content) == ("", THOUGHT)
    opened = _read("none", "Let me see.\n</think>\n\nHi.", starts_in_reasoning=True)
    assert (opened.reasoning, opened.content) == ("", "Let me see.\n</think>\n\nHi.")
    call = THOUGHT + '\n<tool_call>\n{"name": "get", "arguments": {"q": "x"}}\n</tool_call>'
    with_tool = _read("none", call, tools=[TOOL])
    assert with_tool.reasoning == "" and with_tool.content.startswith("<think>\nLet me see.")
    assert [c.name for c in with_tool.tool_calls] == ["get"]
    assert "<tool_call>" not in with_tool.content


def test_reasoning_format_deepseek_legacy_does_both() -> None:
    view = _read("deepseek-legacy", THOUGHT)
    assert (view.reasoning, view.content) == ("Let me see.", THOUGHT)


THINK_GRAMMAR = 'root ::= "<think>\\nhm\\n</think>\\n\\nok"'   # the tiny model writes a thought


def test_reasoning_format_reaches_the_chat_route(tmp_path: Path, tiny_moe: Path,
                                                 server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "grammar": THINK_GRAMMAR,
            "max_tokens": 40}
    status, _, parsed = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, parsed
    message = parsed["choices"][0]["message"]
    assert (message.get("reasoning_content"), message["content"]) == ("hm", "ok"), message
    srv = start_server(tmp_path, "-m", str(tiny_moe), "-c", "512",
                       "--reasoning-format", "none", "--slots", "--no-jinja")
    try:
        assert srv.request("GET", "/slots")[0] == 200                  # --slots
        status, _, kept = srv.request("POST", "/v1/chat/completions", body)
        assert status == 200, kept
        message = kept["choices"][0]["message"]
        assert message["content"] == "<think>\nhm\n</think>\n\nok", message
        assert not message.get("reasoning_content"), message
    finally:
        srv.stop()


def test_model_url_fetches_into_the_models_folder(tmp_path: Path, hub: Hub) -> None:
    site = ["--hf-ca-file", hub.cert, "-c", "256"]
    url = hub.resolve_url(REPO, "stories-Q8_0.gguf")
    data = tmp_path / "data"
    srv = start_server(data, *site, "--model-url", url)
    try:
        info = srv.info()
        assert info["state"] == "ready", info
        assert info["model"]["path"] == str(data / "models" / "stories-Q8_0.gguf")
    finally:
        srv.stop()
    hub.clear()
    srv = start_server(data, *site, "-mu", url, "--offline")
    try:
        assert srv.info()["model"]["name"] == "stories-Q8_0.gguf" and hub.requests == []
    finally:
        srv.stop()


def test_hf_repo_takes_its_projector_unless_no_mmproj(tmp_path: Path, hub: Hub) -> None:
    site = ["--hf-endpoint", hub.url, "--hf-ca-file", hub.cert, "-c", "256"]
    data = tmp_path / "data"
    srv = start_server(data, *site, "--hf-repo", VISION)
    try:
        model = srv.info()["model"]
        assert model["vision"] is True and model["projector"] == "mmproj-tiny-vision-F16.gguf"
    finally:
        srv.stop()
    srv = start_server(data, *site, "--hf-repo", VISION, "--no-mmproj", "--offline")
    try:
        assert srv.info()["model"]["vision"] is False      # not paired from the folder either
    finally:
        srv.stop()
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "m.gguf").write_bytes((data / "models" / "tiny-vision-Q4_K_M.gguf").read_bytes())
    url = hub.resolve_url(VISION, "mmproj-tiny-vision-F16.gguf")
    other = tmp_path / "other"
    srv = start_server(other, *site, "-m", str(alone / "m.gguf"), "--mmproj-url", url)
    try:
        model = srv.info()["model"]
        assert model["vision"] is True, srv.info()
        assert (other / "models" / "mmproj-tiny-vision-F16.gguf").is_file()
    finally:
        srv.stop()

"""llama-server's routes: health, props, slots, tokenizer, metrics, lookups, Ollama's list.

Theory of operation
-------------------
These routes answer as llama-server does (field names, defaults, its error object
`{"error": {"code", "message", "type"}}`, which `register` declares for each route that
has it, `shape=shapes.LLAMA`), so tools written for llama-server work against bmoe. The
generation routes (`/completion`, `/v1/completions`) are in `completions.py`; this
module holds the rest and `register`, their lines of the route table.

Security: every route here is API (key, Host, Origin / `Sec-Fetch-Site`, 415 for
non-JSON POSTs, no CORS); `/health` alone skips the key (`Access.PUBLIC`) and
`/shutdown` answers this machine only (`Access.LOCAL_ONLY`), as `register` says.

Anything that reaches llama.cpp runs on the engine thread, and every token id a client
sends is checked against the vocabulary there first.
"""

from __future__ import annotations

import json
import os
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import trio
from pydantic import StrictBool, StrictStr

from .. import __version__, atomicfile
from ..engine.sampling import check_tokens
from ..engine.session import Session
from ..engine.turn import render_prompt
from ..http import limits
from ..http.errors import HTTPError, invalid_request
from ..http.routes import Access, RouteTable
from ..http.types import Request, Response
from ..models.download import sha256_of
from ..runtime import metrics
from ..runtime.state import Lifecycle, Runtime
from . import gcp, llama_flags, shapes, wire
from .llama_options import attach, llama_options, options_from, slot_count  # noqa: F401
from .protocols import completions, embeddings, openai_chat, responses

PROCESS_START = time.time()   # llama-server's /metrics header
TOKENS_MAX = 1 << 20          # ids in one /detokenize body (the body cap bounds it too)


# -- start-up: llama-server's flags, variables and --config (llama_flags.py) -------------

add_flags = llama_flags.add_flags
check_flags = llama_flags.check_flags
config_argv = llama_flags.config_argv
env_argv = llama_flags.env_argv


def register(table: RouteTable, state: Runtime) -> None:
    def add(method: str, path: str, fn: Callable[..., Any], **kw: Any) -> None:
        table.add(method, path, partial(fn, state), **kw)

    # Text and ids only: the default body cap (8 MiB) is far past any context, and it
    # bounds the tokenizer's buffer. Chat bodies (images) take the big cap.
    big = {"body_limit": limits.BIG_BODY_LIMIT_BYTES}
    llama = {"shape": shapes.LLAMA}          # llama-server's error object
    runs = {"model": True}                   # needs the model: --autoload loads it first
    add("GET", "/health", health, access=Access.PUBLIC, **llama)     # no key, as llama-server
    add("GET", "/v1/health", health, access=Access.PUBLIC, **llama)
    add("POST", "/completion", completions.completion, **llama, **runs)
    add("POST", "/completions", completions.completion, **llama, **runs)
    add("POST", "/v1/completions", completions.openai_completion, **llama, **runs)
    add("POST", "/tokenize", tokenize, **llama, **runs)
    add("POST", "/detokenize", detokenize, **llama, **runs)
    add("POST", "/apply-template", apply_template, **big, **llama, **runs)
    add("POST", "/v1/chat/completions/input_tokens", input_tokens, **big, **runs)
    add("POST", "/chat/completions/input_tokens", input_tokens, **big, **runs)
    for path in ("/v1/responses/input_tokens", "/responses/input_tokens"):
        add("POST", path, responses_input_tokens, shape=shapes.RESPONSES, **big, **runs)
    add("POST", "/chat/completions", openai_chat.handle, **big, **llama, **runs)
    add("GET", "/props", props, **llama)
    add("POST", "/props", set_props, **llama)
    add("GET", "/slots", slots, **llama)
    add("POST", "/slots/{id}", slot_action, **llama)
    add("GET", "/metrics", get_metrics, **llama)
    add("GET", "/models", models, **llama)
    add("GET", "/models/{id}", model, **llama)
    add("GET", "/v1/models/{id}", model, **llama)
    add("GET", "/api/tags", ollama_tags)
    add("POST", "/api/show", ollama_show)
    add("POST", "/shutdown", shutdown, access=Access.LOCAL_ONLY)
    for method in ("GET", "POST"):
        add(method, "/cors-proxy", cors_proxy, **llama)
    gcp.register(table)                 # Vertex AI's /predict, with AIP_MODE=PREDICTION
    embeddings.register(table, state, on_engine)   # with --embedding / --reranking


async def cors_proxy(state: Runtime, request: Request) -> Response:
    """llama-server's web UI fetches other hosts through it (with --ui-mcp-proxy) and is
    refused with 403 without the flag. bmoe-server forwards nothing (its agent reaches
    MCP servers itself): always the refusal."""
    raise HTTPError(403, "no_proxy", "bmoe-server has no CORS proxy and fetches no other "
                    "host for a page. Give its agent the MCP servers instead "
                    "(--mcp-servers-config FILE).")


def not_supported(message: str) -> HTTPError:
    return HTTPError(501, "not_supported", message)


async def ready_session(state: Runtime) -> Session:
    """The loaded model, or 503 as llama-server answers while it loads."""
    if state.state.loading:
        raise HTTPError(503, "loading", "Loading model")
    if state.session is None or state.state != Lifecycle.READY:
        raise HTTPError(503, "no_model", "No model is loaded. Load one with "
                        "POST /api/session/load or start the server with -m.")
    return state.session


async def on_engine(state: Runtime, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(session, *args)`` on the engine thread (the runtime's `job`), refused with
    llama-server's 503 while a model loads instead of waiting for it."""
    await ready_session(state)
    return await state.job(fn, *args)


# -- health, props, slots ----------------------------------------------------------

async def health(state: Runtime, request: Request) -> Response:
    if state.asleep is None:           # asleep (--sleep-idle-seconds) is healthy too
        await ready_session(state)
    return Response.json({"status": "ok"})


def default_settings(state: Runtime, session: Session, slot: int = 0) -> dict[str, Any]:
    params = {**completions.server_sampling(state).settings(), "n_predict": -1,
              "stream": False, "grammar": "", "model": state.model_name()}
    return {"id": slot, "id_task": -1, "n_ctx": session.n_ctx, "speculative": False,
            "is_processing": False, "params": params}


async def props(state: Runtime, request: Request) -> Response:
    if state.asleep is not None:       # as it was, without waking the model
        return Response.json(state.asleep.views["props"])
    return Response.json(props_body(state, await ready_session(state)))


def sleep_views(state: Runtime) -> dict[str, Any]:
    """What `/props` and `/models` say of a model while it sleeps (taken as it falls
    asleep, so the model is still loaded)."""
    assert state.session is not None
    return {"props": props_body(state, state.session, sleeping=True),
            "models": models_body(state)}


def props_body(state: Runtime, session: Session, sleeping: bool = False) -> dict[str, Any]:
    options = llama_options(state)
    return {
        "default_generation_settings": default_settings(state, session),
        "total_slots": slot_count(state), "model_alias": state.model_name(), "model_path": str(session.path),
        "chat_template": session.template_text, "chat_format": session.tool_framing or "none",
        "bos_token": session.bos_token,
        "eos_token": session.eos_token, "modalities": {"vision": session.vision is not None, "audio": False},
        "endpoint_slots": options.slots, "endpoint_props": False,
        "endpoint_metrics": options.metrics, "ui": options.ui,
        "build_info": f"bmoe {__version__}", "n_ctx": session.n_ctx,
        "is_sleeping": sleeping}


async def set_props(state: Runtime, request: Request) -> Response:
    raise not_supported("This server does not support changing global properties.")


async def slots(state: Runtime, request: Request) -> Response:
    if not llama_options(state).slots:
        raise not_supported("This server does not support slots endpoint. Start it with "
                            "`--slots`")
    session = await ready_session(state)
    busy = state.generating
    if busy and request.query.get("fail_on_no_slot") not in (None, "", "0", "false"):
        raise HTTPError(503, "no_slot", "no slot available")
    out = []
    for i in range(slot_count(state)):
        slot = default_settings(state, session, i)
        del slot["params"]                    # llama-server lists a slot's params with --verbose
        running = busy and i == 0             # the one turn that runs is on slot 0
        slot["is_processing"] = running
        slot["prompt"] = ""
        slot["next_token"] = [{"has_next_token": running, "has_new_line": False,
                               "n_remain": -1, "n_decoded": 0, "stopping_word": ""}]
        out.append(slot)
    return Response.json(out)


class SlotFileBody(wire.Wire):
    """`POST /slots/{id}?action=save|restore`: the file in `--slot-save-path`."""
    filename: StrictStr


def slot_file_name(name: str) -> str:
    """A file name in the slots folder, as llama-server's `fs_validate_filename` takes
    one: no folder part, not hidden, no control character, at most 255 bytes."""
    if (not name or len(name.encode("utf-8", "surrogatepass")) > 255 or name.startswith(".")
            or any(c in name for c in "/\\") or any(ord(c) < 32 or ord(c) == 127 for c in name)
            or any("\ud800" <= c <= "\udfff" for c in name)):
        raise invalid_request("Invalid filename: name a file in the slots folder (no folder "
                              "part, not starting with a dot, no control characters).")
    return name


async def slot_action(state: Runtime, request: Request) -> Response:
    """llama-server's slot files: ``save`` writes the KV cache and its tokens to a file in
    `--slot-save-path` (a temporary file, then renamed), ``restore`` reads one back into
    the KV (the next prompt that starts the same way reuses it), ``erase`` empties the KV.
    The one KV sequence is every slot's, so any slot id in range names it. Each runs in
    its turn in the turn line: never under a running answer."""
    folder = llama_options(state).slot_save_path
    if not folder:
        raise not_supported("This server does not support slots action. Start it with "
                            "`--slot-save-path`.")
    raw = request.path_params.get("id", "")
    if not raw.isdigit() or int(raw) >= slot_count(state):
        raise invalid_request(f"Invalid slot id {raw[:20]!r}: the slots are 0 to "
                              f"{slot_count(state) - 1}.")
    slot = int(raw)
    action = request.query.get("action", "")
    if action not in ("save", "restore", "erase"):
        raise invalid_request("Invalid action: use ?action=save, restore or erase.")
    name = ""
    if action != "erase":
        name = slot_file_name(wire.parse(SlotFileBody, request.json_object()).filename)
    await ready_session(state)
    place = state.turns.reserve()
    async with place:
        await place.wait()
        started = time.monotonic()
        if action == "erase":
            n = await on_engine(state, _erase_kv)
            return Response.json({"id_slot": slot, "n_erased": n})
        path = Path(folder) / name
        if action == "save":
            n, size = await _save_kv(state, path)
            return Response.json({"id_slot": slot, "filename": name, "n_saved": n,
                                  "n_written": size, "timings": {
                                      "save_ms": (time.monotonic() - started) * 1e3}})
        if not path.is_file():
            raise HTTPError(404, "not_found", f"There is no slot file {name!r} in the slots "
                            "folder.")
        identity = await on_engine(state, Session.kv_identity)
        await trio.to_thread.run_sync(_check_slot_file, path, identity)
        n, size = await on_engine(state, Session.load_kv, str(path))
        return Response.json({"id_slot": slot, "filename": name, "n_restored": n,
                              "n_read": size, "timings": {
                                  "restore_ms": (time.monotonic() - started) * 1e3}})


def _erase_kv(session: Session) -> int:
    n = len(session.kv_tokens)
    session.clear_kv()
    return n


SLOT_FORMAT = "bmoe-slot-1"


def _sidecar(path: Path) -> Path:
    """The record of a slot file this server wrote (hidden: no request can name it)."""
    return path.with_name(f".{path.name}.slot.json")


def _check_slot_file(path: Path, identity: dict[str, Any]) -> None:
    """Restore only what this server saved, whole, for this model and context: llama.cpp
    reads a state file with asserts, not checks (a file cut short aborts the process at
    GGML_ASSERT(nread <= state_size)), so its bytes are held to the digest taken when
    it was written, and its record to the model and context loaded now."""
    try:
        record = json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or record.get("format") != SLOT_FORMAT:
        raise invalid_request(f"The slot file {path.name!r} was not saved by this server "
                              "(its record is missing): only slots saved here are restored.")
    if record.get("for") != identity:
        raise invalid_request(f"The slot file {path.name!r} was saved for another model or "
                              "context settings: restore it with those loaded.")
    try:
        whole = path.stat().st_size == record.get("size") and sha256_of(path) == record.get("sha256")
    except OSError:
        whole = False
    if not whole:
        raise invalid_request(f"The slot file {path.name!r} has changed since it was saved "
                              "(its size or digest differs): save the slot again.")


async def _save_kv(state: Runtime, path: Path) -> tuple[int, int]:
    """Save through a temporary file in the same folder, renamed over `path` when whole,
    with its record (digest, size, the model and context it holds a state of) beside it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        n, size = await on_engine(state, Session.save_kv, str(tmp))
        identity = await on_engine(state, Session.kv_identity)
        digest = await trio.to_thread.run_sync(sha256_of, tmp)
        record = {"format": SLOT_FORMAT, "size": os.path.getsize(tmp), "sha256": digest,
                  "n_tokens": n, "for": identity}
        _sidecar(path).unlink(missing_ok=True)      # never a record of another file's bytes
        os.replace(tmp, path)
        atomicfile.write_text(_sidecar(path), json.dumps(record, indent=1) + "\n")
    except OSError as e:
        raise HTTPError(500, "failed", f"The slot file could not be written in the slots "
                        f"folder ({e.strerror or 'error'}).") from None
    finally:
        tmp.unlink(missing_ok=True)
    return n, size


# -- tokenizer ---------------------------------------------------------------------

class TokenizeBody(wire.Wire):
    content: StrictStr
    add_special: StrictBool | None = None
    parse_special: StrictBool | None = None
    with_pieces: StrictBool | None = None


class DetokenizeBody(wire.Wire):
    tokens: list[int]


def _tokenize(session: Session, text: str, add_special: bool, parse_special: bool,
              with_pieces: bool) -> list[Any]:
    ids = session.tokenize(text, special=parse_special, add_special=add_special)
    if not with_pieces:
        return ids
    out = []
    for t in ids:
        raw = session.token_bytes(t)
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": t, "piece": piece})
    return out


def _detokenize(session: Session, ids: list[int]) -> str:
    check_tokens(ids, session.n_vocab, "tokens")
    return b"".join(session.token_bytes(t) for t in ids).decode("utf-8", "replace")


async def tokenize(state: Runtime, request: Request) -> Response:
    body = wire.parse(TokenizeBody, request.json_object())
    tokens = await on_engine(state, _tokenize, body.content, bool(body.add_special),
                             body.parse_special is not False, bool(body.with_pieces))
    return Response.json({"tokens": tokens})


async def detokenize(state: Runtime, request: Request) -> Response:
    raw = request.json_object()
    if isinstance(raw.get("tokens"), list) and len(raw["tokens"]) > TOKENS_MAX:
        raise invalid_request(f"`tokens` holds more than {TOKENS_MAX} ids.")
    body = wire.parse(DetokenizeBody, {"tokens": [], **raw})
    return Response.json({"content": await on_engine(state, _detokenize, list(body.tokens))})


# -- chat prompts ------------------------------------------------------------------

def _render(session: Session, req: Any, with_ids: bool) -> dict[str, Any]:
    text = render_prompt(session, req)
    out: dict[str, Any] = {"prompt": text}
    if with_ids:
        out["prompt_ids"] = session.tokenize(text)
    return out


class TemplateFlags(wire.Wire):
    """`/apply-template` reads a chat body (`openai_chat.decode`) and this flag."""
    return_prompt_ids: StrictBool | None = None


async def apply_template(state: Runtime, request: Request) -> Response:
    body = request.json_object()
    flag = wire.parse(TemplateFlags, body).return_prompt_ids
    req = openai_chat.decode(body, state.config)
    return Response.json(await on_engine(state, _render, req, bool(flag)))


async def input_tokens(state: Runtime, request: Request) -> Response:
    req = openai_chat.decode(request.json_object(), state.config)
    out = await on_engine(state, _render, req, True)
    return Response.json({"input_tokens": len(out["prompt_ids"])})


async def responses_input_tokens(state: Runtime, request: Request) -> Response:
    """OpenAI's `POST /v1/responses/input_tokens`: the tokens a Responses body's prompt
    takes (its input, instructions and tools rendered through the chat template)."""
    req = responses.decode(request.json_object(), state.config)
    out = await on_engine(state, _render, req, True)
    return Response.json({"object": "response.input_tokens",
                          "input_tokens": len(out["prompt_ids"])})


# -- stopping ----------------------------------------------------------------------

SHUTDOWN_DELAY_S = 0.2   # the answer goes out before the stop begins


async def shutdown(state: Runtime, request: Request) -> Response:
    """Stop the server as SIGTERM does (the running answer ends, exit 0); from this
    machine only (registered `Access.LOCAL_ONLY`: the access checks refuse the network first)."""
    request.json_object()

    async def later() -> None:
        await trio.sleep(SHUTDOWN_DELAY_S)
        os.kill(os.getpid(), signal.SIGTERM)

    trio.lowlevel.spawn_system_task(later)
    return Response.json({"status": "stopping"})


# -- metrics -----------------------------------------------------------------------

async def get_metrics(state: Runtime, request: Request) -> Response:
    if not state.llama_options.metrics:
        raise not_supported("This server does not support metrics endpoint. Start it with "
                            "`--metrics`.")
    process = request.query.get("process") not in (None, "", "0", "false")
    return Response(body=metrics.exposition(state, process), content_type=metrics.CONTENT_TYPE,
                    headers=[("Process-Start-Time-Unix", str(int(PROCESS_START)))])


# -- model lookups -----------------------------------------------------------------

def _entry(state: Runtime) -> dict[str, Any] | None:
    info = state.model_info()
    if info is None:
        return None
    return {"id": info["id"], "aliases": list(state.model_aliases),
            "tags": list(state.model_tags), "object": "model", "owned_by": "local",
            "created": 0, "modalities": ["text", "image"] if info["vision"] else ["text"],
            "meta": {"n_ctx": info["n_ctx"], "n_vocab": state.session.n_vocab
                     if state.session is not None else 0}}


async def models(state: Runtime, request: Request) -> Response:
    """`/v1/models` and `/models`: OpenAI's list (`data`) and, as llama-server adds it,
    the Ollama-style `models` list whose `capabilities` say `multimodal` for a model
    that reads images (a sleeping model is listed as it was)."""
    if state.asleep is not None:
        return Response.json(state.asleep.views["models"])
    return Response.json(models_body(state))


def models_body(state: Runtime) -> dict[str, Any]:
    entry = _entry(state)
    listed = []
    if entry is not None:
        vision = "image" in entry["modalities"]
        listed.append({"name": entry["id"], "model": entry["id"], "modified_at": "",
                       "size": "", "digest": "", "type": "model", "description": "",
                       "tags": entry["tags"] or [""],
                       "capabilities": ["completion", *(["multimodal"] if vision else [])],
                       "parameters": "",
                       "details": _details(state.session) if state.session is not None
                       else {}})
    return {"models": listed, "object": "list", "data": [entry] if entry else []}


def _find(state: Runtime, name: str) -> dict[str, Any]:
    entry = _entry(state)
    if entry is None or name not in (entry["id"], *entry["aliases"]):
        served = f"it serves {entry['id']}" if entry else "no model is loaded"
        raise HTTPError(404, "not_found", f"This server does not serve {name[:200]!r}: {served}.")
    return entry


async def model(state: Runtime, request: Request) -> Response:
    return Response.json(_find(state, request.path_params.get("id", "")))


def _details(session: Session) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": session.arch,
            "families": [session.arch], "parameter_size": "", "quantization_level": ""}


def _capabilities(session: Session) -> list[str]:
    return ["completion", *(["tools"] if session.tool_framing else []),
            *(["vision"] if session.vision is not None else [])]


async def ollama_tags(state: Runtime, request: Request) -> Response:
    entry, session = _entry(state), state.session
    listed = []
    if entry is not None and session is not None:
        try:
            size = session.path.stat().st_size
        except OSError:
            size = 0
        listed.append({"name": entry["id"], "model": entry["id"], "modified_at": "",
                       "size": size, "digest": "", "type": "model", "description": "",
                       "tags": [""], "capabilities": _capabilities(session), "parameters": "",
                       "details": _details(session)})
    return Response.json({"models": listed})


class ShowBody(wire.Wire):
    model: StrictStr | None = None
    name: StrictStr | None = None


async def ollama_show(state: Runtime, request: Request) -> Response:
    body = wire.parse(ShowBody, request.json_object())
    name = body.model if body.model is not None else body.name
    if name is None:
        raise invalid_request("`model` is required.")
    _find(state, name)
    session = await ready_session(state)
    return Response.json({
        "template": session.template_text, "modified_at": "", "modelfile": "",
        "parameters": "", "details": _details(session),
        "model_info": {"general.architecture": session.arch,
                       f"{session.arch}.context_length": session.n_ctx},
        "capabilities": _capabilities(session)})

"""`bmoe-cli`: one-shot generation, a line-protocol session, the model maker, the table.

    bmoe-cli make-model --out tiny.gguf            write a test/benchmark GGUF
    bmoe-cli --describe-params                     the parameter table as JSON
    bmoe-cli -m MODEL -p PROMPT [flags]            stream one answer
    bmoe-cli -m MODEL -p PROMPT --progress         ... as the telemetry contract's lines
    bmoe-cli -m MODEL -p PROMPT --csv run.csv      ... plus one CSV row per token
    bmoe-cli -m MODEL --session                    JSON requests on stdin, lines on stdout
    bmoe-cli -m MODEL --plan [--json]              the plan for this machine, then exit
    bmoe-cli -m MODEL -p PROMPT --auto             plan, run with it, predicted vs measured

The output lines are bmoe's telemetry protocol (docs/decide-events-cli.md):
`BMOE_LOAD` / `BMOE_PROGRESS` per token, the `=== answer ===` / `=== perf ===` banners
and the `generation:` / `moe-stream:` / `moe-cache:` lines; in session mode the control
lines `BMOE_READY`, `BMOE_BEGIN`, `BMOE_DONE`, `BMOE_DECIDE`, `BMOE_ERROR`. Messages
name settings by their flag (`params.render(..., "flag")`).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
from dataclasses import dataclass, field
from typing import IO, Any, Callable, TypeVar

from pydantic import StrictBool, StrictInt, StrictStr, ValidationError

from .engine import params
from .server.wire import Wire, first_problem

MIB = 1 << 20
CSV_HEADER = "step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct,stall_ms,mgmt_ms"
MAX_LINE_BYTES = 16 * MIB     # one session request; a longer line is refused whole
NO_ID = -1                    # the id of an error about a line that named none


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bmoe-cli", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-p", "--prompt", help="the user message to answer")
    p.add_argument("--describe-params", action="store_true",
                   help="print the parameter table as JSON and exit")
    p.add_argument("--progress", action="store_true",
                   help="machine-readable per-token lines and the answer / perf banners")
    p.add_argument("--csv", metavar="PATH", help="write one CSV row per token to PATH")
    p.add_argument("--session", action="store_true",
                   help="keep the model loaded: JSON requests on stdin, one per line")
    p.add_argument("--json-schema", metavar="FILE",
                   help="the answer must be JSON matching the JSON schema in FILE")
    p.add_argument("--grammar", metavar="FILE",
                   help="the answer must match the llama.cpp GBNF grammar in FILE")
    params.add_cli_flags(p, server=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "make-model":
        from .modelmaker import main_make_model   # not the engine: see "running one turn"
        return main_make_model(argv[1:])
    if "--plan" in argv or "--auto" in argv:     # the planner's modes (bmoe/planner/cli.py)
        # Imported here, not above: the planner loads llama.cpp and numpy (1.3 s), which
        # make-model and --describe-params do not need. (Not a cycle: it imports no cli.)
        from .planner import cli as plan_cli
        return plan_cli.main(argv, plan_cli.add_plan_flags(build_parser()), run_planned)
    args = build_parser().parse_args(argv)
    if args.describe_params:
        json.dump(params.describe(server=False), sys.stdout, indent=1)
        print()
        return 0
    values = params.defaults(server=False)
    values.update(params.values_from_namespace(args))
    if not values.get("model") or (args.prompt is None and not args.session):
        print("bmoe-cli: give a model (-m PATH) and a prompt (-p TEXT) or --session; "
              "see --help.", file=sys.stderr)
        return 2
    error = params.validate(values)
    if error:
        print("bmoe-cli: " + params.render(error, "flag"), file=sys.stderr)
        return 2
    try:
        constraint = read_constraint(args.json_schema, args.grammar)
    except ValueError as e:
        print(f"bmoe-cli: {e}", file=sys.stderr)
        return 2
    out = Console(sys.stdout)
    if args.session:
        return run_session(values, out, sys.stdin.buffer, constraint)
    return generate_once(values, args.prompt, out, progress=args.progress, csv_path=args.csv,
                         constraint=constraint)


def read_constraint(schema_file: str | None, grammar_file: str | None) -> dict[str, Any]:
    """The TurnRequest fields --json-schema / --grammar ask for (ValueError: a sentence)."""
    if schema_file and grammar_file:
        raise ValueError("give --json-schema or --grammar, not both")
    if grammar_file:
        return {"grammar": _read_text(grammar_file, "--grammar")}
    if not schema_file:
        return {}
    try:
        schema = json.loads(_read_text(schema_file, "--json-schema"))
    except ValueError:
        raise ValueError(f"--json-schema: {schema_file} is not JSON") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema: {schema_file} must hold a JSON object schema")
    return {"schema": schema or {"type": "object"}}


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: cannot read {path} ({e.__class__.__name__})") from None


# --- output ------------------------------------------------------------------------------

class Console:
    """Whole lines to a text stream, one writer at a time (the session's two threads)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            self.stream.write(text)
            self.stream.flush()

    def tagged(self, tag: str, obj: dict[str, Any]) -> None:
        self.write(f"{tag} {dumps(obj)}\n")


def dumps(obj: Any) -> str:
    """Compact JSON on one line; a lone surrogate (from a client's JSON) is escaped."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(obj, separators=(",", ":"))
    return text


def _r(value: Any, digits: int = 3) -> float:
    return round(float(value or 0.0), digits)


def progress_lines(rec: dict[str, Any], text: str) -> str:
    """`BMOE_LOAD` (only when experts were read) and `BMOE_PROGRESS` for one token."""
    read_mib = float(rec.get("read_mib", 0.0) or 0.0)
    lines = ""
    if read_mib > 0:
        lines += f"BMOE_LOAD {dumps({'mb': _r(read_mib, 4), 'ms': _r(rec.get('io_ms'))})}\n"
    progress = {
        "step": rec["step"], "steps": rec["steps"], "wall_ms": _r(rec.get("wall_ms")),
        "io_ms": _r(rec.get("io_ms")), "compute_ms": _r(rec.get("compute_ms")),
        "mgmt_ms": _r(rec.get("mgmt_ms")), "stall_ms": _r(rec.get("stall_ms")),
        "read_mb": _r(read_mib, 4), "cache_hit_pct": _r(rec.get("cache_hit_pct", -1), 2),
        "text": text}
    return lines + f"BMOE_PROGRESS {dumps(progress)}\n"


def csv_row(rec: dict[str, Any], telemetry: dict[str, Any]) -> str:
    read_bytes = telemetry.get("read_bytes")
    if read_bytes is None:
        read_bytes = round(float(rec.get("read_mib", 0.0) or 0.0) * MIB)
    cells = [rec["step"], rec["steps"], _r(rec.get("wall_ms")), _r(rec.get("io_ms")),
             _r(rec.get("compute_ms")), int(read_bytes), _r(rec.get("cache_hit_pct", -1), 2),
             _r(rec.get("stall_ms")), _r(rec.get("mgmt_ms"))]
    return ",".join(str(c) for c in cells) + "\n"


def csv_summary(s: dict[str, Any]) -> str:
    s_tok = 1.0 / s["tok_s"] if s["tok_s"] else 0.0
    return (f"# summary tokens={s['tokens']} s/tok={s_tok:.6f} tok/s={s['tok_s']:.3f} "
            f"read_mib={s['read_mib']:.3f} io_s/tok={s['io_s_tok']:.6f} "
            f"compute_s/tok={s['compute_s_tok']:.6f} stall_s/tok={s['stall_s_tok']:.6f} "
            f"mgmt_s/tok={s['mgmt_s_tok']:.6f} cache_hit_pct={float(s['cache_hit_pct']):.2f} "
            f"prefill_s={s['prefill_s']:.4f} n_prompt={s['n_prompt']}\n")


def perf_lines(s: dict[str, Any], streamer: dict[str, Any] | None) -> str:
    """`generation:`, then `moe-stream:` when experts stream and `moe-cache:` when a
    cache is active (``streamer`` is the streamer's summary, None without one)."""
    n, tok_s = s["tokens"], s["tok_s"]
    s_tok = 1.0 / tok_s if tok_s else 0.0
    out = f"generation: {n} tokens, {s_tok:.4f} s/token ({tok_s:.2f} tok/s)\n"
    if streamer is None:
        return out
    read = float(s["read_mib"])
    io_total = s["io_s_tok"] * n
    bw = read / io_total if io_total > 0 else 0.0
    out += (f"moe-stream: read {read:.1f} MiB ({read / n if n else 0.0:.2f} MiB/token), "
            f"decode {s_tok:.4f} s/token (compute {s['compute_s_tok']:.4f} + cache mgmt "
            f"{s['mgmt_s_tok']:.4f} + flash I/O {s['io_s_tok']:.4f} s/token, {bw:.1f} MiB/s)")
    if streamer.get("overlap"):
        out += f", stall_s/tok={s['stall_s_tok']:.4f}"
    out += "\n"
    if streamer.get("prefetch"):
        done, useful = int(streamer.get("spec_prefetched", 0)), int(streamer.get("spec_useful", 0))
        out += (f"moe-prefetch: {float(streamer.get('spec_read_mib', 0.0)):.1f} MiB speculative, "
                f"{useful}/{done} experts useful ({100.0 * useful / done if done else 0.0:.1f}%)\n")
        out += (f"moe-spec-gate: {max(0.0, float(streamer.get('spec_recall_pct', 0.0))):.1f}% "
                "router prediction recall\n")
    if float(s["cache_hit_pct"]) >= 0:
        out += (f"moe-cache: {float(s['cache_hit_pct']):.1f}% hit, resident "
                f"{float(s['cache_resident_mib']):.1f} MiB\n")
    return out


# --- running one turn ----------------------------------------------------------------------
# The engine's modules are imported inside the functions that run a model (here and in
# session mode): they load llama.cpp (about a second), which make-model, --describe-params
# and a refused command line never need.

def open_session(values: dict[str, Any]) -> Any:
    # The engine's modules load llama.cpp and numpy: imported where a model runs, so that
    # --help, --describe-params and make-model start at once (the same below).
    from .engine.experts import streamer_factory
    from .engine.session import Session
    return Session(values["model"], values, streamer_factory)


def one_turn(session: Any, messages: list[dict[str, Any]], sink: "TurnSink", *,
             max_tokens: int, think: bool, constraint: dict[str, Any] | None = None,
             cancel: threading.Event | None = None, budget_must_fit: bool = False,
             prepared: Callable[[], None] | None = None) -> Any:
    """bmoe-cli's one way to run a turn (a prompt, `--auto`'s prompt, a session request):
    the messages as a chat on a model with a chat template; a base model (none)
    continues their text, as llama-cli does. With `budget_must_fit` the prompt plus
    `max_tokens` must fit the context (a session's request: it would stop short);
    `prepared()` is called once the prompt is ready, before the first token.

    The CLI runs the engine on this thread, one turn at a time: it has no HTTP side, no
    turn line and no event bus, so it calls the engine's `prepare` / `run_turn` (the
    same path the server's runtime drives) rather than the runtime."""
    from .engine.errors import EngineError
    from .engine.turn import TurnRequest, prepare, run_turn
    raw: list[str | int] | None = (
        None if session.template is not None else ["".join(m["content"] for m in messages)])
    req = TurnRequest(messages=messages if raw is None else [], raw_prompt=raw,
                      max_tokens=max_tokens, think=think, **(constraint or {}))
    ready = prepare(session, req)
    if budget_must_fit and max_tokens and len(ready.tokens) + max_tokens > session.n_ctx:
        raise EngineError("context_full", f"the prompt ({len(ready.tokens)} tokens) plus "
                          f"{{n-predict}} ({max_tokens}) exceeds {{ctx-size}} "
                          f"({session.n_ctx})")
    if prepared is not None:
        prepared()
    return run_turn(session, ready, req, cancel or threading.Event(), sink.emit)


@dataclass
class TurnSink:
    """What one turn's tokens go to: the console (inline text or progress lines) and a CSV."""

    out: Console
    progress: bool
    csv: IO[str] | None = None
    pieces: list[str] = field(default_factory=list)

    def emit(self, ev: Any, rec: dict[str, Any]) -> None:
        self.pieces.append(ev.text)
        if self.progress:
            self.out.write(progress_lines(rec, "".join(self.pieces)))
        else:
            self.out.write(ev.text)
        if self.csv is not None:
            self.csv.write(csv_row(rec, ev.telemetry))


def generate_once(values: dict[str, Any], prompt: str, out: Console, *, progress: bool = False,
                  csv_path: str | None = None, constraint: dict[str, Any] | None = None) -> int:
    from .engine.errors import EngineError

    try:
        session = open_session(values)
    except EngineError as e:
        print("bmoe-cli: " + params.render(e.message, "flag"), file=sys.stderr)
        return 1
    csv_file = None
    try:
        if csv_path:
            csv_file = open(csv_path, "w", encoding="utf-8", newline="")
            csv_file.write(CSV_HEADER + "\n")
        sink = TurnSink(out, progress, csv_file)
        result = one_turn(session, [{"role": "user", "content": prompt}], sink,
                          max_tokens=int(values.get("n-predict") or 0),
                          think=bool(values.get("think", True)), constraint=constraint)
        streamer = session.streamer.summary() if session.streamer is not None else None
        perf = perf_lines(result.summary, streamer)
        if progress:
            out.write(f"=== answer ===\n{result.generation.text}\n=== perf ===\n{perf}")
        else:
            out.write("\n")
            print(perf, end="", file=sys.stderr, flush=True)
        if csv_file is not None:
            csv_file.write(csv_summary(result.summary))
    except EngineError as e:
        print("bmoe-cli: " + params.render(e.message, "flag"), file=sys.stderr)
        return 1
    except OSError as e:
        print(f"bmoe-cli: cannot write {csv_path}: {e}", file=sys.stderr)
        return 1
    finally:
        if csv_file is not None:
            csv_file.close()
        session.close()
    return 0


def run_planned(values: dict[str, Any], prompt: str) -> tuple[dict[str, Any], list[Any]] | None:
    """`--auto`'s prompt with the planned values: the answer on stdout, the perf lines on
    stderr; (the summary, the routing the streamer recorded), or None on an engine error."""
    from .engine.errors import EngineError

    out = Console(sys.stdout)
    try:
        session = open_session(values)
    except EngineError as e:
        print("bmoe-cli: " + params.render(e.message, "flag"), file=sys.stderr)
        return None
    try:
        streamer = session.streamer
        if streamer is not None:
            streamer.record_routing = True
        result = one_turn(session, [{"role": "user", "content": prompt}], TurnSink(out, False),
                          max_tokens=int(values.get("n-predict") or 0),
                          think=bool(values.get("think", True)))
        out.write("\n")
        summary = result.summary
        print(perf_lines(summary, streamer.summary() if streamer else None), end="",
              file=sys.stderr)
        return summary, list(getattr(streamer, "routing", []) or [])
    except EngineError as e:
        print("bmoe-cli: " + params.render(e.message, "flag"), file=sys.stderr)
        return None
    finally:
        session.close()


# --- session mode ------------------------------------------------------------------------------

class RequestError(ValueError):
    """A session request that is refused (BMOE_ERROR fatal:false); carries its id."""

    def __init__(self, message: str, req_id: int = NO_ID) -> None:
        super().__init__(message)
        self.req_id = req_id


class _GenerateLine(Wire):
    prompt: StrictStr
    n_predict: StrictInt | None = None
    think: StrictBool | None = None
    clear_kv: StrictBool | None = None


class _DecideLine(Wire):
    choices: list[StrictStr]
    prefix: StrictStr | None = None
    suffix: StrictStr | None = None
    reuse_prefix: StrictBool | None = None


W = TypeVar("W", bound=Wire)


def _checked(model: type[W], obj: dict[str, Any], req_id: int) -> W:
    """A request line against its wire model; RequestError naming the field otherwise."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise RequestError(first_problem(e.errors(include_url=False, include_input=False)),
                           req_id) from None


def parse_request(line: bytes, values: dict[str, Any]) -> dict[str, Any]:
    """One stdin line as a checked request; RequestError for anything else."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(f"not a JSON line: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError("a request must be a JSON object")
    raw_id = obj.get("id", NO_ID)
    if not isinstance(raw_id, int) or isinstance(raw_id, bool):
        raise RequestError("`id` must be an integer")
    req_id = raw_id
    cmd = obj.get("cmd")
    if cmd in ("cancel", "close"):
        return {"cmd": cmd, "id": req_id}
    if cmd == "generate":
        return _generate_request(obj, req_id, values)
    if cmd == "decide":
        return _decide_request(obj, req_id)
    raise RequestError(f"unknown cmd {str(cmd)[:40]!r}: generate, decide, cancel or close",
                       req_id)


def _generate_request(obj: dict[str, Any], req_id: int, values: dict[str, Any]) -> dict[str, Any]:
    line = _checked(_GenerateLine, obj, req_id)
    n_predict = int(values.get("n-predict") or 0) if line.n_predict is None else line.n_predict
    try:
        params.parse_value(params.param("n-predict"), n_predict)
    except ValueError as e:
        raise RequestError(params.render(str(e), "flag"), req_id) from None
    return {"cmd": "generate", "id": req_id, "prompt": line.prompt, "n_predict": n_predict,
            "think": bool(values.get("think", True)) if line.think is None else line.think,
            "clear_kv": True if line.clear_kv is None else line.clear_kv}


def _decide_request(obj: dict[str, Any], req_id: int) -> dict[str, Any]:
    line = _checked(_DecideLine, obj, req_id)
    return {"cmd": "decide", "id": req_id, "prefix": line.prefix or "",
            "suffix": line.suffix or "", "choices": list(line.choices),
            "reuse_prefix": True if line.reuse_prefix is None else line.reuse_prefix}


class InFlight:
    """The cancel flag of the request running now, which the stdin thread may set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancel: threading.Event | None = None

    def begin(self) -> threading.Event:
        with self._lock:
            self._cancel = threading.Event()
            return self._cancel

    def end(self) -> None:
        with self._lock:
            self._cancel = None

    def cancel(self) -> None:
        with self._lock:
            if self._cancel is not None:
                self._cancel.set()


def read_requests(stdin: IO[bytes], requests: "queue.Queue[dict[str, Any] | None]",
                  inflight: InFlight, out: Console, values: dict[str, Any]) -> None:
    """The stdin thread: cancels act at once, the rest queue in order; EOF is a close."""
    while True:
        line = stdin.readline(MAX_LINE_BYTES + 1)
        if not line:
            break
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (more := stdin.readline(MAX_LINE_BYTES)) and not more.endswith(b"\n"):
                pass
            out.tagged("BMOE_ERROR", {"id": NO_ID, "fatal": False,
                                      "msg": f"a request line over {MAX_LINE_BYTES} bytes"})
            continue
        if not line.strip():
            continue
        try:
            req = parse_request(line, values)
        except RequestError as e:
            out.tagged("BMOE_ERROR", {"id": e.req_id, "fatal": False, "msg": str(e)})
            continue
        if req["cmd"] == "cancel":
            inflight.cancel()
            continue
        requests.put(req)
        if req["cmd"] == "close":
            return
    requests.put(None)


class SessionMode:
    """The main thread of `--session`: one request at a time on the loaded session."""

    def __init__(self, session: Any, values: dict[str, Any], out: Console,
                 constraint: dict[str, Any] | None = None) -> None:
        self.session = session
        self.values = values
        self.out = out
        self.constraint = constraint or {}   # --json-schema / --grammar, for every answer
        self.inflight = InFlight()
        self.history: list[dict[str, Any]] = []

    def error(self, req_id: int, message: str, fatal: bool = False) -> None:
        self.out.tagged("BMOE_ERROR", {"id": req_id, "fatal": fatal,
                                       "msg": params.render(message, "flag")})

    def serve(self, requests: "queue.Queue[dict[str, Any] | None]") -> int:
        from .engine.errors import EngineError
        while (req := requests.get()) is not None and req["cmd"] != "close":
            run: Callable[[dict[str, Any]], None] = (
                self.generate if req["cmd"] == "generate" else self.decide)
            try:
                run(req)
            except EngineError as e:
                self.error(req["id"], e.message)
            except Exception as e:  # noqa: BLE001 - the engine's own failure ends the session
                self.error(req["id"], f"the engine failed: {e!r}", fatal=True)
                return 1
            finally:
                self.inflight.end()
        return 0

    def generate(self, req: dict[str, Any]) -> None:
        s = self.session
        history = [] if req["clear_kv"] else self.history
        if req["clear_kv"]:
            s.clear_kv()
        messages = [*history, {"role": "user", "content": req["prompt"]}]
        cancel = self.inflight.begin()
        result = one_turn(s, messages, TurnSink(self.out, progress=True),
                          max_tokens=req["n_predict"], think=req["think"],
                          constraint=self.constraint, cancel=cancel, budget_must_fit=True,
                          prepared=lambda: self.out.tagged("BMOE_BEGIN", {"id": req["id"]}))
        text = result.generation.text
        self.history = [*messages, {"role": "assistant", "content": text}]
        recall = s.streamer.summary().get("spec_recall_pct", -1) if s.streamer else -1
        done = {"id": req["id"], **result.summary, "spec_recall_pct": recall, "text": text}
        self.out.tagged("BMOE_DONE", done)

    def decide(self, req: dict[str, Any]) -> None:
        from .engine.decide import DecideRequest, decide
        cancel = self.inflight.begin()
        result = decide(self.session, DecideRequest(req["prefix"], req["suffix"], req["choices"],
                                                    req["reuse_prefix"]), cancel)
        self.out.tagged("BMOE_DECIDE", {"id": req["id"], **result.answer()})


def run_session(values: dict[str, Any], out: Console, stdin: IO[bytes],
                constraint: dict[str, Any] | None = None) -> int:
    from .engine.errors import EngineError
    try:
        session = open_session(values)
    except EngineError as e:
        out.tagged("BMOE_ERROR", {"id": NO_ID, "fatal": True,
                                  "msg": params.render(e.message, "flag")})
        return 1
    try:
        out.tagged("BMOE_READY", {"load_s": round(session.load_s, 3), "arch": session.arch,
                                  "n_ctx": session.n_ctx})
        mode = SessionMode(session, values, out, constraint)
        requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
        reader = threading.Thread(target=read_requests, name="bmoe-stdin", daemon=True,
                                  args=(stdin, requests, mode.inflight, out, values))
        reader.start()
        return mode.serve(requests)
    finally:
        session.close()


if __name__ == "__main__":
    sys.exit(main())

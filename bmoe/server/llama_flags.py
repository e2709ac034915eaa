"""llama-server's command line: its flags, its `LLAMA_ARG_*` variables and `--config`.

Theory of operation
-------------------
A llama-server command line starts `bmoe-server`. Each flag of llama-server's lands in
one of three places:

* **the parameter table** (`bmoe/engine/params.py`): a flag that sets what the engine
  does (`-c`, `-b`, `-ub`, `-fa`, `-ctk`, `-ctv`, `--swa-full`, `--chat-template`,
  `--no-mmproj`, ...) is a row's flag or switch, and its variable is the row's `env`;
* **`LLAMA_FLAGS`** below: a flag about the server (`--alias`, `--no-ui`, `--no-slots`,
  `--parallel`, `--hf-repo`, ...), or one this server takes without acting on it, each
  with what it does here. One that would ask for something this server must not
  pretend to do is refused by name, with the reason (`refuse`); one that changes
  nothing here is taken with one line saying so (`note`);
* the server's own flags that llama-server shares (`--host`, `--port`, `--api-key`,
  `--metrics`, `--models-dir`, `--mcp-servers-config`), in `main.build_parser`.

The same names hold everywhere: a `--config` file's key is a flag's long name without
its dashes (`config_argv`), and a variable is read as its flag (`env_argv`) unless the
command line gives that flag in any spelling. As llama.cpp does, `_` in a long flag's
name reads as `-` (`--backend_sampling`), `respell`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Literal

from ..engine import params

Kind = Literal["value", "switch"]
REFUSED = "refused"


@dataclass(frozen=True)
class LlamaFlag:
    """One flag of llama-server's that is not a row of the parameter table.

    `names` are its spellings (the first is the one lines show; the longest `--` one
    names it: `long`, `dest`), `negative` the spellings that turn a switch off. `note`
    is the line printed when it is given (`{value}` is its value); `refuse` the reason
    it is refused. Neither: it does what `help` says, silently."""

    names: tuple[str, ...]
    help: str
    env: str | None = None
    metavar: str | None = None          # None: a switch
    negative: tuple[str, ...] = ()
    note: str = ""
    refuse: str = ""
    group: str = ""                     # flags of one group share one line (`note`)
    choices: tuple[str, ...] = ()

    @property
    def long(self) -> str:
        return max((n for n in self.names if n.startswith("--")), key=len)

    @property
    def dest(self) -> str:
        return "llama_" + self.long.lstrip("-").replace("-", "_")

    @property
    def kind(self) -> Kind:
        return "switch" if self.metavar is None else "value"


CPU_ONLY = "this build runs on the CPU, so {flags} {verb} no effect."
NO_SPEC = ("speculative decoding is not built here, so {flags} {verb} no effect: the "
           "answers are the same, without a draft's speed-up.")
NO_TOOLS = ("llama-server's built-in tools and MCP proxy are not served here, so {flags} "
            "{verb} no effect (bmoe's agent has its own tools: docs/agent.md).")


def _flags() -> tuple[LlamaFlag, ...]:
    F = LlamaFlag
    return (
        # -- the model, named the way llama-server names it --------------------------
        F(("-hf", "-hfr", "--hf-repo"), "a Hugging Face repository <user>/<model>[:quant]: "
          "its file in the models folder, fetched from --hf-endpoint first if it is not "
          "there (with --offline, never)", env="LLAMA_ARG_HF_REPO", metavar="REPO"),
        F(("-hff", "--hf-file"), "the file of --hf-repo to use (instead of its quant)",
          env="LLAMA_ARG_HF_FILE", metavar="FILE"),
        F(("-hft", "--hf-token"), "the Hugging Face token a gated --hf-repo needs (default: "
          "HF_TOKEN)", metavar="TOKEN"),
        F(("-mu", "--model-url"), "a model file's https URL: the file of that name in the "
          "models folder, fetched first if it is not there", env="LLAMA_ARG_MODEL_URL",
          metavar="URL"),
        F(("-mmu", "--mmproj-url"), "an image projector's https URL, as --model-url",
          env="LLAMA_ARG_MMPROJ_URL", metavar="URL"),
        F(("--offline",), "never fetch at start: --hf-repo and the URLs must name files "
          "the models folder has", env="LLAMA_ARG_OFFLINE"),
        F(("-a", "--alias"), "the model's name (comma-separated names: the first is the "
          "one answers carry) in /v1/models, /props and responses' model",
          env="LLAMA_ARG_ALIAS", metavar="NAMES"),
        F(("--tags",), "tags shown in /v1/models (comma-separated, informational)",
          env="LLAMA_ARG_TAGS", metavar="TAGS"),
        # -- what the server offers ------------------------------------------------
        F(("--slots",), "serve GET /slots (the default)", env="LLAMA_ARG_ENDPOINT_SLOTS",
          negative=("--no-slots",)),
        F(("--webui", "--ui"), "serve the web UI at / (the default)", env="LLAMA_ARG_UI",
          negative=("--no-webui", "--no-ui")),
        F(("--jinja",), "render chat templates with Jinja (always, here)",
          env="LLAMA_ARG_JINJA", negative=("--no-jinja",)),
        F(("--reasoning-format",), "where a thinking model's reasoning goes: auto and "
          "deepseek put it in reasoning_content, none leaves it in the content as written "
          "(tags and all), deepseek-legacy does both", env="LLAMA_ARG_THINK",
          metavar="FORMAT", choices=("none", "auto", "deepseek", "deepseek-legacy")),
        F(("-rea", "--reasoning"), "on or off sets --think / --no-think (auto: the "
          "template's default)", env="LLAMA_ARG_REASONING", metavar="on|off|auto"),
        F(("-np", "--parallel"), "llama-server's slot count: accepted; this server "
          "serves one turn at a time, the others wait in line", env="LLAMA_ARG_N_PARALLEL",
          metavar="N"),
        F(("-cb", "--cont-batching"), "continuous batching: one turn at a time here, so "
          "there is nothing to batch", env="LLAMA_ARG_CONT_BATCHING",
          negative=("-nocb", "--no-cont-batching")),
        F(("-kvu", "--kv-unified"), "one KV buffer for every sequence: the one sequence "
          "here has one already", env="LLAMA_ARG_KV_UNIFIED",
          negative=("-no-kvu", "--no-kv-unified")),
        F(("--models-autoload",), "load the saved model when a request finds none "
          "loaded (this server's --autoload)", env="LLAMA_ARG_MODELS_AUTOLOAD",
          negative=("--no-models-autoload",)),
        F(("--models-max",), "llama-server's router: how many models it keeps loaded",
          env="LLAMA_ARG_MODELS_MAX", metavar="N",
          note="--models-max {value}: this server keeps one model loaded at a time "
               "(POST /api/session/load switches)."),
        F(("--models-preset",), "llama-server's router presets (INI)",
          env="LLAMA_ARG_MODELS_PRESET", metavar="PATH",
          refuse="this server has no router: it serves the one model -m or the settings "
                 "name, and switches with POST /api/session/load, so a preset file would "
                 "go unread."),
        F(("--cors-origins",), "origins whose pages may use the API (comma-separated): "
          "read as --allow-origin; * is refused", env="LLAMA_ARG_CORS_ORIGINS",
          metavar="ORIGINS"),
        F(("--sleep-idle-seconds",), "unload the model after this many seconds with no "
          "request using it; the next request that needs it loads it again (-1: never)",
          metavar="S"),
        F(("-cram", "--cache-ram"), "llama-server's prompt cache in RAM (MiB)",
          env="LLAMA_ARG_CACHE_RAM", metavar="MIB",
          note="--cache-ram {value}: there is no prompt cache in RAM here; the KV cache "
               "keeps the last conversation's prefix for the next turn."),
        F(("--cache-idle-slots",), "llama-server saves idle slots to its prompt cache",
          env="LLAMA_ARG_CACHE_IDLE_SLOTS", negative=("--no-cache-idle-slots",),
          note="--cache-idle-slots: there is no prompt cache in RAM here."),
        F(("--slot-save-path",), "the folder POST /slots/{id}?action=save writes the KV "
          "cache to, and restore reads it from", metavar="PATH"),
        F(("--context-shift",), "llama-server drops old context when it is full",
          env="LLAMA_ARG_CONTEXT_SHIFT", negative=("--no-context-shift",),
          note="--context-shift: the context does not shift here; an answer ends where "
               "the context is full."),
        F(("--media-path",), "llama-server reads file:// images from this folder",
          metavar="PATH",
          note="--media-path: images come in the request here (data: URLs); file:// "
               "URLs are not read."),
        F(("-v", "--log-verbose", "--verbose"), "log every line (bmoe's debug log)"),
        F(("-bs", "--backend-sampling"), "llama-server's sampling on the device",
          env="LLAMA_ARG_BACKEND_SAMPLING",
          note="--backend-sampling: sampling runs on the CPU here."),
        # -- what this server does not compute -------------------------------------
        F(("--rerank", "--reranking"), "serve /rerank: sets --embedding and --pooling "
          "rank (for a reranker model)", env="LLAMA_ARG_RERANKING"),
        F(("--lora",), "a LoRA adapter", metavar="FILE",
          refuse="this engine applies no LoRA adapter, so the answers would be the base "
                 "model's, not the adapter's."),
        F(("-gan", "--grp-attn-n"), "self-extend's group factor", metavar="N",
          refuse="llama-server does not take it either (self-extend is llama-cli's); "
                 "this engine has no self-extend."),
        F(("-gaw", "--grp-attn-w"), "self-extend's group width", metavar="N",
          refuse="llama-server does not take it either (self-extend is llama-cli's); "
                 "this engine has no self-extend."),
        # -- speculative decoding (speed only) -------------------------------------
        F(("--spec-draft-model", "-md", "--model-draft"), "a draft model",
          env="LLAMA_ARG_SPEC_DRAFT_MODEL", metavar="FILE", note=NO_SPEC, group="spec"),
        F(("--spec-type",), "speculative decoding's kinds", env="LLAMA_ARG_SPEC_TYPE",
          metavar="TYPES", note=NO_SPEC, group="spec"),
        F(("--spec-draft-n-max", "--draft-max"), "tokens a draft proposes",
          env="LLAMA_ARG_SPEC_DRAFT_N_MAX", metavar="N", note=NO_SPEC, group="spec"),
        F(("--spec-draft-n-min", "--draft-min"), "the fewest tokens a draft proposes",
          env="LLAMA_ARG_SPEC_DRAFT_N_MIN", metavar="N", note=NO_SPEC, group="spec"),
        F(("--spec-synth-len",), "synthetic acceptance (benchmarking)",
          env="LLAMA_ARG_SPEC_SYNTH_LEN", metavar="L", note=NO_SPEC, group="spec"),
        F(("--spec-synth-rates",), "synthetic acceptance rates (benchmarking)",
          env="LLAMA_ARG_SPEC_SYNTH_RATES", metavar="P0,P1,...", note=NO_SPEC,
          group="spec"),
        # -- llama-server's web-UI tools -------------------------------------------
        F(("--webui-mcp-proxy", "--ui-mcp-proxy"), "llama-server's MCP CORS proxy",
          env="LLAMA_ARG_UI_MCP_PROXY", negative=("--no-webui-mcp-proxy",
                                                  "--no-ui-mcp-proxy"),
          note=NO_TOOLS, group="tools"),
        F(("--tools",), "llama-server's built-in tools", env="LLAMA_ARG_TOOLS",
          metavar="TOOLS", note=NO_TOOLS, group="tools"),
        F(("--tools-runtime",), "where llama-server's tools run",
          env="LLAMA_ARG_TOOLS_RUNTIME", metavar="OPTION", note=NO_TOOLS, group="tools"),
        F(("--mcp-servers-json",), "MCP servers as inline JSON",
          env="LLAMA_ARG_MCP_SERVERS_JSON", metavar="JSON",
          note="--mcp-servers-json is not read: give bmoe's agent the same servers in a "
               "file, --mcp-servers-config FILE."),
        # -- hardware this build does not have -------------------------------------
        F(("-ngl", "--gpu-layers", "--n-gpu-layers"), "layers on a GPU",
          env="LLAMA_ARG_N_GPU_LAYERS", metavar="N", note=CPU_ONLY, group="gpu"),
        F(("-dev", "--device"), "devices to offload to", env="LLAMA_ARG_DEVICE",
          metavar="DEVS", note=CPU_ONLY, group="gpu"),
        F(("-sm", "--split-mode"), "how to split over GPUs", env="LLAMA_ARG_SPLIT_MODE",
          metavar="MODE", note=CPU_ONLY, group="gpu"),
        F(("-ts", "--tensor-split"), "GPUs' shares", env="LLAMA_ARG_TENSOR_SPLIT",
          metavar="N0,N1,...", note=CPU_ONLY, group="gpu"),
        F(("-mg", "--main-gpu"), "the main GPU", env="LLAMA_ARG_MAIN_GPU",
          metavar="INDEX", note=CPU_ONLY, group="gpu"),
    )


LLAMA_FLAGS: tuple[LlamaFlag, ...] = _flags()
BY_LONG = {f.long: f for f in LLAMA_FLAGS}


def add_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of `LLAMA_FLAGS`, plus `--config` and `--metrics`. A flag not given
    leaves None (a switch: None, True or False), so `check_flags` can tell."""
    p.add_argument("--config", metavar="FILE",
                   help="read flags from one JSON object ({\"ctx-size\": 8192, ...}); the "
                        "command line replaces its entries")
    p.add_argument("--metrics", action="store_true",
                   help="serve GET /metrics (Prometheus text format), as llama-server's "
                        "--metrics")
    group = p.add_argument_group("llama-server's flags")
    for f in LLAMA_FLAGS:
        shown = f"{f.help}; refused: {f.refuse}" if f.refuse else f.help
        shown = shown.replace("%", "%%")
        if f.kind == "value":
            group.add_argument(*f.names, dest=f.dest, metavar=f.metavar, default=None,
                               action="append" if f.long in APPENDED else "store",
                               help=shown)
            continue
        group.add_argument(*f.names, dest=f.dest, action="store_const", const=True,
                           default=None, help=shown)
        if f.negative:
            group.add_argument(*f.negative, dest=f.dest, action="store_const", const=False,
                               help=f"turns {f.long} off")


APPENDED = ("--alias", "--tags", "--cors-origins")   # given twice (or a config list): both
SILENT_AT = {"--cache-ram": "0", "--sleep-idle-seconds": "-1",   # values that ask for
             "--models-max": "1"}                                 # what this server does


def given(args: Any, f: LlamaFlag) -> Any:
    return getattr(args, f.dest, None)


def _shown(f: LlamaFlag, value: Any) -> str:
    if value is True:
        return f.names[0]
    if value is False:
        return f.negative[-1]
    text = ",".join(value) if isinstance(value, list) else str(value)
    return f"{f.names[0]} {text}"


def check_flags(args: Any) -> list[str]:
    """The refusals (SystemExit, by name) and the lines to print for llama-server's
    flags; also carries the ones that map onto another flag into `args`."""
    lines: list[str] = []
    groups: dict[str, list[str]] = {}
    for f in LLAMA_FLAGS:
        value = given(args, f)
        if value is None or value is False:
            continue
        if f.refuse:
            named = "/".join(f.names) + ("" if f.kind == "switch" else f" {value}")
            raise SystemExit(f"bmoe-server: {named} is refused: {f.refuse}")
        if f.note and not (f.long in SILENT_AT and str(value).strip() == SILENT_AT[f.long]):
            if f.group:
                groups.setdefault(f.group, []).append(_shown(f, value))
                continue
            shown = ",".join(value) if isinstance(value, list) else str(value)
            lines.append(f.note.format(value=shown))
    for group, spelled in groups.items():
        note = next(f.note for f in LLAMA_FLAGS if f.group == group)
        lines.append(note.format(flags=", ".join(spelled),
                                 verb="have" if len(spelled) > 1 else "has"))
    lines += _carry(args)
    return lines


def _carry(args: Any) -> list[str]:
    """The flags that stand for another flag, set on `args`; their lines."""
    lines: list[str] = []
    parallel = given(args, BY_LONG["--parallel"])
    if parallel is not None:
        n = _count(parallel, "--parallel", low=-1)
        if n == 0:
            raise SystemExit("bmoe-server: --parallel 0 is refused: give 1 or more (-1: "
                             "auto), as llama-server does.")
        if n > 1:
            unified = bool(given(args, BY_LONG["--kv-unified"]))
            ctx = getattr(args, "ctx_size", None)
            if ctx and not unified:
                # llama-server's slots split the context; so do these: each slot (and so
                # each turn) has ctx / N tokens, as its /props and /slots say.
                args.ctx_size = max(1, int(ctx) // n)
                per = f"{args.ctx_size} tokens of context each (-c {ctx} split, as " \
                      "llama-server splits it without --kv-unified)"
            else:
                per = "the whole context each"
            lines.append(f"--parallel {parallel}: {n} slots, {per}; this server serves one "
                         "turn at a time, the others wait in line.")
    reasoning = given(args, BY_LONG["--reasoning"])
    if reasoning is not None:
        word = str(reasoning).strip().lower()
        think = {"on": True, "enabled": True, "true": True, "1": True, "off": False,
                 "disabled": False, "false": False, "0": False}.get(word)
        if think is None and word not in ("auto", "-1"):
            raise SystemExit(f"bmoe-server: --reasoning {reasoning!r} is not on, off or auto.")
        if think is not None and not hasattr(args, "think"):
            args.think = think
    if given(args, BY_LONG["--reranking"]):
        args.embedding = True
        args.pooling = "rank"
    fmt = given(args, BY_LONG["--reasoning-format"])
    if fmt is not None:
        allowed = BY_LONG["--reasoning-format"].choices
        if fmt not in allowed:
            raise SystemExit(f"bmoe-server: --reasoning-format {fmt!r} is not one of "
                             f"{', '.join(allowed)}.")
    if given(args, BY_LONG["--jinja"]) is False:
        lines.append("--no-jinja: a model's own chat template is rendered with Jinja here "
                     "(a --chat-template name is rendered as llama-server renders it); as in "
                     "llama-server's legacy chat, no reasoning is let before an answer "
                     "schema's or a forced call's output.")
    if given(args, BY_LONG["--models-autoload"]) and not getattr(args, "autoload", False):
        args.autoload = True
    lines += _carry_origins(args)
    for name in ("--models-max", "--sleep-idle-seconds", "--cache-ram"):
        value = given(args, BY_LONG[name])
        if value is not None:
            _count(value, name, low=-1)
    return lines


def _carry_origins(args: Any) -> list[str]:
    value = given(args, BY_LONG["--cors-origins"])
    if value is None:
        return []
    origins = [o.strip() for item in value for o in str(item).split(",") if o.strip()]
    if "*" in origins:
        raise SystemExit("bmoe-server: --cors-origins * is refused: it would let every web "
                         "page use this server. Name the origins (docs/security.md).")
    named = [o for o in origins if o != "localhost"]
    args.allow_origin = [*getattr(args, "allow_origin", []), *named]
    if not named:
        return []
    return [f"--cors-origins read as --allow-origin {' '.join(named)}: those pages may "
            "use the API; no CORS header is sent (docs/security.md)."]


def _count(value: Any, name: str, *, low: int) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise SystemExit(f"bmoe-server: {name} {value!r} is not a whole number.") from None
    if n < low:
        raise SystemExit(f"bmoe-server: {name} {n} is below {low}.")
    return n


def split_names(value: Any) -> tuple[str, ...]:
    """An --alias / --tags value (given once or more, comma-separated) as its names."""
    items = value if isinstance(value, list) else [value] if value else []
    return tuple(dict.fromkeys(n.strip() for item in items for n in str(item).split(",")
                               if n.strip()))


# -- underscores, as llama.cpp reads them ------------------------------------------

def respell(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--name_with_underscores` read as `--name-with-underscores` where only that
    spelling is a flag (llama.cpp's parser does the same for every `--` argument)."""
    known = parser._option_string_actions
    out = []
    for a in argv:
        flag, eq, rest = a.partition("=")
        if a.startswith("--") and "_" in flag and flag not in known:
            dashed = flag.replace("_", "-")
            if dashed in known:
                a = dashed + eq + rest
        out.append(a)
    return out


# -- LLAMA_ARG_* variables ---------------------------------------------------------

@dataclass(frozen=True)
class EnvFlag:
    flag: str                      # what the variable is read as
    kind: Literal["value", "switch", "on-off"]
    off: str = ""                  # on-off: the flag for a false value


SERVER_VARS: dict[str, EnvFlag] = {
    "LLAMA_ARG_PORT": EnvFlag("--port", "value"),
    "LLAMA_API_KEY": EnvFlag("--api-key", "value"),
    "LLAMA_ARG_API_KEY_FILE": EnvFlag("--api-key-file", "value"),
    "LLAMA_ARG_ENDPOINT_METRICS": EnvFlag("--metrics", "switch"),
    "LLAMA_ARG_MODELS_DIR": EnvFlag("--models-dir", "value"),
    "LLAMA_ARG_MCP_SERVERS_CONFIG": EnvFlag("--mcp-servers-config", "value"),
}
SECRET_VARS = ("LLAMA_API_KEY",)
KEY_FLAGS = ("--api-key", "--api-key-file")      # either replaces both key variables
_TRUE = ("on", "enabled", "true", "1")
_FALSE = ("off", "disabled", "false", "0")


def env_table() -> dict[str, EnvFlag]:
    """Every variable this server reads, and the flag it stands for: the table's rows,
    `LLAMA_FLAGS`, then the server's own."""
    out: dict[str, EnvFlag] = {}
    for p in params.table():
        if p.env is None:
            continue
        if p.type == "bool":
            off = next(s.flag for s in p.switches if s.value is False)
            out[p.env] = EnvFlag(p.flag, "on-off", off)
        else:
            out[p.env] = EnvFlag(p.flag, "value")
    for f in LLAMA_FLAGS:
        if f.env is None:
            continue
        if f.kind == "value":
            out[f.env] = EnvFlag(f.long, "value")
        else:
            out[f.env] = EnvFlag(f.long, "on-off" if f.negative else "switch",
                                 f.negative[-1] if f.negative else "")
    out.update(SERVER_VARS)
    return out


def _spellings(parser: argparse.ArgumentParser, flag: str) -> set[str]:
    """Every option string that sets what `flag` sets (its dest), both ways."""
    actions = parser._option_string_actions
    dest = actions[flag].dest
    if flag in KEY_FLAGS:
        return set(KEY_FLAGS)
    return {s for s, a in actions.items() if a.dest == dest}


def _on_command_line(argv: list[str], spellings: set[str]) -> bool:
    return any(a in spellings or (a.startswith("--") and a.split("=", 1)[0] in spellings)
               for a in argv)


def env_argv(argv: list[str], environ: dict[str, str],
             parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """The command line with llama-server's variables read in, and one line for each
    variable saying what it was read as (a key's value is never shown). SystemExit for
    a variable that names no key, or a switch's that is neither on nor off. `parser` is
    bmoe-server's whole parser (every family's flags: the composition root builds it)."""
    table = env_table()
    extra: list[str] = []
    lines: list[str] = []
    for var in sorted(v for v in environ if v.startswith("LLAMA_ARG_") or v == "LLAMA_API_KEY"):
        value = environ[var]
        read = table.get(var)
        if read is None:
            why = " (the address widens only with --host)" if var == "LLAMA_ARG_HOST" else ""
            lines.append(f"{var} is not read by bmoe-server{why}.")
            continue
        if _on_command_line(argv, _spellings(parser, read.flag)) or \
                _on_command_line(extra, _spellings(parser, read.flag)):
            lines.append(f"{var} is replaced by the command line's {read.flag}.")
            continue
        args, line = _env_entry(var, value, read)
        extra += args
        if line:
            lines.append(line)
    return [*argv, *extra], lines


def _env_entry(var: str, value: str, read: EnvFlag) -> tuple[list[str], str]:
    word = value.strip().lower()
    if read.kind == "value":
        if var in SECRET_VARS and not value.strip():
            raise SystemExit(f"bmoe-server: {var} is set but names no key.")
        shown = "(the key)" if var in SECRET_VARS else value
        return [f"{read.flag}={value}"] if value.startswith("-") else [read.flag, value], \
            f"{var} read as {read.flag} {shown}."
    if word in _TRUE:
        return [read.flag], f"{var} read as {read.flag}."
    if read.kind == "switch":
        return [], ""                       # llama.cpp reads a switch's variable only when on
    if word in _FALSE:
        return [read.off], f"{var} read as {read.off}."
    raise SystemExit(f"bmoe-server: {var}={value!r} is neither on nor off "
                     f"({', '.join(_TRUE)} / {', '.join(_FALSE)}).")


# -- --config FILE -----------------------------------------------------------------

CONFIG_MAX_BYTES = 1 << 20
CONFIG_ACTIONS = ("help", "version", "config")   # keys that ask the start to do something
CONFIG_QUIET = ("api-key",)                     # entries whose value is never printed


def config_argv(argv: list[str], parser: Any) -> tuple[list[str], list[str]]:
    """`--config FILE` (one JSON object of flags, llama-server's rules) read into the
    command line, and one line for each entry saying what it was read as. The command
    line's flag, in any spelling, replaces the file's entry. SystemExit names what is
    refused."""
    spots = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not spots:
        return argv, []
    if len(spots) > 1:
        raise SystemExit("bmoe-server: --config is given twice.")
    i = spots[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            raise SystemExit("bmoe-server: --config needs a file.")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1:]
    actions = parser._option_string_actions
    given_dests = {actions[a.split("=", 1)[0]].dest for a in rest
                   if a.startswith("-") and a.split("=", 1)[0] in actions}
    extra: list[str] = []
    lines: list[str] = []
    for key, value in _read_config(path):
        args, line = _config_entry(path, key, value, actions, given_dests)
        extra += args
        lines.append(line)
    return [*extra, *rest], lines


def _read_config(path: str) -> list[tuple[str, Any]]:
    def refuse(why: str) -> SystemExit:
        return SystemExit(f"bmoe-server: --config {path}: {why}")

    try:
        with open(path, "rb") as f:
            data = f.read(CONFIG_MAX_BYTES + 1)
    except OSError as e:
        raise refuse(f"cannot be read ({e.strerror or 'unreadable'}).") from None
    if len(data) > CONFIG_MAX_BYTES:
        raise refuse(f"is larger than {CONFIG_MAX_BYTES} bytes.")
    try:                                # every object as its (key, value) pairs, in order
        decoded = json.loads(data.decode("utf-8"), object_pairs_hook=lambda kv: kv)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise refuse("is not JSON.") from None
    if not isinstance(decoded, list) or any(not isinstance(kv, tuple) for kv in decoded):
        raise refuse("is not one JSON object of flags.")
    keys = [k for k, _ in decoded]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise refuse(f"names {twice[0]} twice.")
    return list(decoded)


def _config_entry(path: str, key: str, value: Any, actions: dict[str, Any],
                  given_dests: set[str]) -> tuple[list[str], str]:
    def refuse(why: str) -> SystemExit:
        return SystemExit(f"bmoe-server: --config {path}: {why}")

    if key.startswith("-"):
        raise refuse(f"write the key {key} without its dashes.")
    if key in CONFIG_ACTIONS:
        raise refuse(f"{key} asks the start to do something; it is not a setting.")
    flag = "--" + key
    action = actions.get(flag)
    if action is None:
        raise refuse(f"{key} is not a flag of bmoe-server.")
    if action.dest in given_dests:
        return [], f"{path}: {key} is replaced by the command line's {flag}."
    switch = action.nargs == 0
    if value is True:
        if not switch:
            raise refuse(f"{key} takes a value, not true.")
        return [flag], f"{path}: {key} read as {flag}."
    if value is False or value is None or isinstance(value, (dict, tuple)) or value == []:
        raise refuse(f"{key} cannot be {_json_text(value)}: give a value, or leave it out.")
    if switch:
        raise refuse(f"{key} is a switch: give true, or leave it out.")
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, (bool, dict, list, tuple)) or v is None for v in values):
        raise refuse(f"{key} takes strings or numbers.")
    out: list[str] = []
    for v in values:                    # a value that starts with - stays the flag's
        text = str(v)
        out += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    shown = "(not shown)" if key in CONFIG_QUIET else " ".join(str(v) for v in values)
    return out, f"{path}: {key} read as {flag} {shown}."


def _json_text(value: Any) -> str:
    if value is False:
        return "false"
    if value is None:
        return "null"
    return "an empty list" if value == [] else "an object"

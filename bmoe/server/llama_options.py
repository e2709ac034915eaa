"""What llama-server's flags set for its routes: the model's names and tags, the optional
routes served, the slots (`--parallel`). Read by the llama-server routes and the
completion handlers; set once at start (`attach`)."""

from __future__ import annotations

from typing import Any

from ..runtime.options import LlamaOptions
from ..runtime.state import Runtime
from . import llama_flags


def options_from(args: Any) -> LlamaOptions:
    F = llama_flags.BY_LONG
    given = llama_flags.given
    parallel = given(args, F["--parallel"])
    return LlamaOptions(
        # llama-server keeps both in a sorted set: the model's id is the first alias in
        # that order (`--alias tinyllama-2,fim,code` serves as "code"), as there
        aliases=tuple(sorted(llama_flags.split_names(given(args, F["--alias"])))),
        tags=tuple(sorted(llama_flags.split_names(given(args, F["--tags"])))),
        slots=given(args, F["--slots"]) is not False,
        metrics=bool(getattr(args, "metrics", False)),
        ui=given(args, F["--webui"]) is not False,
        reasoning_format=given(args, F["--reasoning-format"]) or "auto",
        parallel=int(parallel) if parallel is not None else 1,
        verbose=bool(given(args, F["--log-verbose"])),
        jinja=given(args, F["--jinja"]) is not False,
        slot_save_path=str(given(args, F["--slot-save-path"]) or ""))


def attach(state: Runtime, args: Any) -> None:
    options = options_from(args)
    state.llama_options = options
    state.model_aliases = options.aliases
    state.model_tags = options.tags


def llama_options(state: Runtime) -> LlamaOptions:
    return state.llama_options


def slot_count(state: Runtime) -> int:
    """llama-server's slots (`--parallel N`): each has the context the engine holds (the
    -c split N ways, unless --kv-unified); one turn runs at a time on them."""
    return max(1, llama_options(state).parallel)

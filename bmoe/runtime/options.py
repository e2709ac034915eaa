"""What llama-server's flags set for a run (`--alias`, `--parallel`, `--reasoning-format`,
`--no-jinja`, ...): one frozen value the runtime holds (`Runtime.llama_options`), read by
the turn, the llama-server routes and the protocols. `bmoe/server/llama_options.py` reads
it from the command line."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaOptions:
    """What llama-server's flags set for these routes: the model's names and tags, and
    which of llama-server's optional routes are served."""

    aliases: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    slots: bool = True
    metrics: bool = False
    ui: bool = True
    reasoning_format: str = "auto"
    parallel: int = 1                  # as asked; one turn runs at a time whatever it is
    verbose: bool = False              # --verbose: every chat answer carries __verbose
    jinja: bool = True                 # --no-jinja: llama-server's legacy chat (no reasoning
                                       # before a schema's or a forced call's output)
    slot_save_path: str = ""           # --slot-save-path: POST /slots/{id} save / restore

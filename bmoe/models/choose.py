"""Which of a repository's models a command line means: `REPO[:QUANT]` or `--hf-file`.

Pure: takes the rows of a repository's listing (`POST /api/hf/models`' `models`, each
with `name`, `quant`, `role`, `complete`, `files`) and returns the one to fetch with the
sentence that says why it was taken.

The quantization is the tag's, exactly (case aside); a tag the repository does not have
is refused with the ones it has. Without a tag the first of `QUANT_PREFERENCE` the
repository has is taken, else its first complete model (the order of its listing):
Q4_K_M first, as llama-server chooses, then the other 4-bit types, then larger ones
before smaller, since a model people ask for by its repository alone is one they
expect to answer well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .catalog import quant_of
from .errors import ModelsError

QUANT_PREFERENCE = ("Q4_K_M", "Q4_K_S", "Q4_0", "IQ4_XS", "IQ4_NL", "MXFP4_MOE", "MXFP4",
                    "Q5_K_M", "Q5_K_S", "Q5_0", "Q6_K", "Q8_0", "Q3_K_M", "Q3_K_L",
                    "IQ3_XXS", "Q3_K_S", "Q2_K", "BF16", "F16", "F32")


@dataclass(frozen=True)
class Choice:
    model: dict[str, Any]       # the listing's row
    why: str                    # the sentence said before anything is fetched

    @property
    def name(self) -> str:
        return str(self.model["name"])

    @property
    def quant(self) -> str:
        return row_quant(self.model)


def split_ref(text: str) -> tuple[str, str]:
    """`owner/name[:QUANT]` as (repo, quant)."""
    repo, _, quant = text.strip().partition(":")
    return repo, quant.strip()


def row_quant(row: dict[str, Any]) -> str:
    return str(row.get("quant") or quant_of(str(row["name"]).rsplit("/", 1)[-1]))


def usable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("role") == "model" and r.get("complete")]


def quants_of(rows: list[dict[str, Any]]) -> str:
    """The quantizations the repository's complete models have, in its order, in words
    (a model whose name names none is named by its file)."""
    tagged = list(dict.fromkeys(row_quant(r) for r in usable(rows) if row_quant(r)))
    bare = [str(r["name"]) for r in usable(rows) if not row_quant(r)]
    words = ", ".join(tagged) or "no quantization in any name"
    if bare:
        words += f"; and {', '.join(bare)}, named by no quantization"
    return words


def choose(repo: str, rows: list[dict[str, Any]], quant: str = "", file: str = "") -> Choice:
    if file:
        return _by_file(repo, rows, file)
    models = usable(rows)
    if not models:
        raise ModelsError(404, "not_found", f"{repo} has no complete GGUF model.")
    if quant:
        found = next((r for r in models if row_quant(r).lower() == quant.lower()), None)
        if found is None:
            raise ModelsError(404, "no_such_quant", f"{repo} has no {quant} model (it has "
                              f"{quants_of(rows)}).")
        return Choice(found, f"{repo}: {found['name']} ({row_quant(found)}, as asked)")
    ranked = {q.lower(): i for i, q in enumerate(QUANT_PREFERENCE)}
    best = min(models, key=lambda r: ranked.get(row_quant(r).lower(), len(ranked)))
    if row_quant(best).lower() in ranked:
        why = (f"no quantization named, so {row_quant(best)}: the first of the preference "
               f"order ({', '.join(QUANT_PREFERENCE[:4])}, ...) that {repo} has")
    else:
        why = f"no quantization named, and none {repo} has is ranked: its first model"
    return Choice(best, f"{repo}: {best['name']} ({why}; it has "
                        f"{quants_of(rows)})")


def _by_file(repo: str, rows: list[dict[str, Any]], file: str) -> Choice:
    for r in rows:
        if any(f.get("path") == file for f in r.get("files", [])):
            if not r.get("complete"):
                raise ModelsError(409, "incomplete", f"{r['name']} is a split set with "
                                  f"shards missing on {repo}.")
            return Choice(r, f"{repo}: {r['name']} (--hf-file)")
    raise ModelsError(404, "not_found", f"{repo} has no file {file!r}.")


def projector(rows: list[dict[str, Any]], model: dict[str, Any]) -> dict[str, Any] | None:
    """The repository's image projector for `model`: of several, the one in the model's
    folder, then F16 (what conversions write first), then the first by name."""
    found = [r for r in rows if r.get("role") == "projector" and r.get("complete")]
    if not found:
        return None
    folder = str(model["name"]).rpartition("/")[0]

    def rank(r: dict[str, Any]) -> tuple[bool, bool, str]:
        return (str(r["name"]).rpartition("/")[0] != folder, row_quant(r) != "F16",
                str(r["name"]))
    return min(found, key=rank)

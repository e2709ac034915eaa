"""llama.cpp's own server test suite, unchanged, against bmoe-server (`_llama_suite`).

The suite comes from the pinned llama-cpp-python sdist (fetched into the test cache);
its cases start bmoe-server with llama-server's own command lines (no flag stripped) and
talk to it with `requests` and the `openai` SDK. Every case llama-server itself passes on
the same model (`_llama_suite_expected.BASELINE_PASSED`) must pass here, except the
documented `EXCEPTIONS`; an exception that passes must leave the list.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from _llama_suite import run
from _llama_suite_expected import BASELINE_PASSED, CI_FILES, CI_LEAVES_OUT, EXCEPTIONS

ROOT = Path(__file__).resolve().parent.parent


def _selection() -> list[str]:
    every = os.environ.get("BMOE_LLAMA_SUITE") == "all"
    return sorted(c for c in BASELINE_PASSED
                  if every or (c.split("::")[0] in CI_FILES and c not in CI_LEAVES_OUT))


def test_the_suite_passes_where_llama_server_does(tmp_path_factory: pytest.TempPathFactory
                                                  ) -> None:
    selection = _selection()
    assert len(selection) > 40, selection                 # the files CI runs have cases
    outcomes = run(tmp_path_factory.mktemp("llama-suite"), selection)
    missing = [c for c in selection if c not in outcomes]
    assert not missing, f"cases the suite did not run: {missing}"
    failed = [c for c in selection if outcomes[c] != "passed" and c not in EXCEPTIONS]
    assert not failed, f"{len(failed)} of {len(selection)} failed: {failed}"
    stale = [c for c in selection if c in EXCEPTIONS and outcomes[c] == "passed"]
    assert not stale, f"these pass now: take them off the exception list: {stale}"


def test_every_exception_is_a_baseline_case_with_a_reason_in_the_docs() -> None:
    docs = " ".join((ROOT / "docs" / "api.md").read_text().split())
    for case, reason in EXCEPTIONS.items():
        assert case in BASELINE_PASSED, case
        assert len(reason) > 20 and reason.endswith("."), (case, reason)
        test = case.split("::")[1].split("[")[0]
        assert f"`{test}`" in docs, f"docs/api.md does not name {test}"
    said = re.search(r"passes (\d+) of the suite's (\d+) cases", docs)
    assert said is not None and int(said.group(1)) == len(BASELINE_PASSED), said
    ci = [c for c in BASELINE_PASSED
          if c.split("::")[0] in CI_FILES and c not in CI_LEAVES_OUT]
    said = re.search(r"(\d+) of the (\d+) cases llama-server itself passes in the files CI "
                     r"runs", docs)
    assert said is not None, "docs/api.md gives no count"
    assert int(said.group(2)) == len(ci)
    assert int(said.group(1)) == len(ci) - len([c for c in EXCEPTIONS if c in ci])

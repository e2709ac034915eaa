"""The parameter table: well-formed, its flags parse, its command lines round-trip."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from bmoe.engine import params
from bmoe.engine.params import Param

ROWS = params.table()
KEYS = [p.key for p in ROWS]
REQUIRED = ["key", "label", "type", "group", "group_label", "group_help", "group_order",
            "level", "form", "scope", "help", "flag", "default"]
OPTIONAL = ["details", "short", "switches", "choices", "min", "max", "unit", "typical",
            "special", "lossy", "accepts_auto", "group_read_only", "launch_only"]
JSON_TYPE: dict[str, type | tuple[type, ...]] = {
    "bool": bool, "int": int, "float": float, "path": str, "text": str, "choice": str}

EXPECTED_ROWS = [
    "model", "mmproj", "mmproj-auto", "chat-template", "chat-template-file",
    "chat-template-kwargs", "image-max-tokens",
    "n-predict", "think", "ctx-size", "threads", "threads-batch", "trial-threads",
    "trial-overlap", "temp", "top-k", "top-p", "seed",
    "moe-stream", "io-threads", "o-direct", "huge-pages", "packed-experts",
    "prefetch", "spec-gate", "overlap", "prefill-ahead", "cache-mb", "cache-policy",
    "cache-fill", "cache-floor-mb", "cache-ceil-mb", "dense-weights", "repack", "rpc",
    "rpc-layers", "batch-size", "ubatch-size", "flash-attn", "cache-type-k", "cache-type-v",
    "swa-full", "embedding", "pooling", "force-cache", "load-all", "decide"]


def parser(server: bool = False) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bmoe-cli", exit_on_error=False)
    params.add_cli_flags(ap, server=server)
    return ap


def parse(args: list[str], server: bool = False) -> dict[str, Any]:
    return params.values_from_namespace(parser(server).parse_args(args))


def other_value(p: Param) -> Any:
    """A valid value that differs from both defaults, to exercise the flag."""
    if p.type == "bool":
        return not p.default
    if p.type == "choice":
        return next(c.value for c in p.choices if c.value != p.default)
    if p.key == "rpc":
        return "10.0.0.2:50052,10.0.0.3:50052"
    if p.key == "chat-template":
        return "chatml"
    if p.key == "chat-template-kwargs":
        return '{"enable_thinking": false}'
    if p.type in ("path", "text"):
        return "/models/some model.gguf"
    if p.type == "float":
        return (p.min + p.max) / 4
    low = p.min if p.min is not None else 0
    return next(v for v in range(low + 1, low + 10)
                if v not in (p.default, p.server_default) and (p.max is None or v <= p.max))


# --- the table ----------------------------------------------------------------------

def test_rows_are_the_ones_whose_machinery_is_built() -> None:
    assert KEYS == EXPECTED_ROWS


def test_keys_and_flags_are_unique() -> None:
    assert len(set(KEYS)) == len(KEYS)
    flags = [f for p in ROWS for f in [p.flag, p.short, *(s.flag for s in p.switches)] if f]
    assert len(set(flags)) == len(flags)


@pytest.mark.parametrize("p", ROWS, ids=KEYS)
def test_row_is_well_formed(p: Param) -> None:
    assert p.flag == f"--{p.key}"
    assert p.label and p.help and p.group_label and p.group_help
    assert p.level in ("basic", "advanced", "experimental", "debug")
    assert p.scope in ("session", "request")
    if p.level == "basic":
        assert p.form
    if p.form:
        assert p.details, f"form row {p.key} needs details"
    for value in {p.default, p.default_for(True)}:
        assert params.parse_value(p, value) == value
    if p.type == "choice":
        assert p.choices
    if p.type == "bool":
        assert any(s.value is False for s in p.switches), "a bool needs a way to turn off"


def test_every_form_row_has_details() -> None:
    missing = [p.key for p in ROWS if p.form and not p.details.strip()]
    assert missing == []


def test_groups_agree_and_only_model_is_read_only() -> None:
    seen: dict[str, tuple[str, str, int]] = {}
    for p in ROWS:
        info = (p.group_label, p.group_help, p.group_order)
        assert seen.setdefault(p.group, info) == info
    assert {p.group for p in ROWS if p.group_read_only} == {"model"}
    orders = [o for _, _, o in seen.values()]
    assert len(set(orders)) == len(orders)
    assert seen["cache"] == (seen["cache"][0], seen["cache"][1], 5)


def test_server_defaults_differ_where_the_reference_says() -> None:
    cli, server = params.defaults(False), params.defaults(True)
    assert (cli["cache-mb"], server["cache-mb"]) == (0, "auto")
    assert (cli["moe-stream"], server["moe-stream"]) == (False, True)
    assert (cli["ctx-size"], server["ctx-size"]) == (4096, 16384)
    assert (cli["n-predict"], server["n-predict"]) == (128, 0)
    assert (cli["decide"], server["decide"]) == (False, True)
    assert 1 <= server["threads"] <= params.MAX_THREADS
    assert server["seed"] == 4294967295 and server["dense-weights"] == "anon"


def test_param_lookup() -> None:
    assert params.param("ctx-size").label == "Context"
    with pytest.raises(KeyError):
        params.param("no-such-thing")


# --- describe -----------------------------------------------------------------------

@pytest.mark.parametrize("server", [False, True])
def test_describe_shape(server: bool) -> None:
    described = params.describe(server)
    json.dumps(described)  # plain JSON
    assert [d["key"] for d in described] == KEYS
    for d, p in zip(described, ROWS, strict=False):
        assert all(k in d for k in REQUIRED), d["key"]
        assert set(d) <= set(REQUIRED) | set(OPTIONAL), d["key"]
        assert d["default"] == p.default_for(server)
        assert d["form"] is p.form and isinstance(d["group_order"], int)
        for s in d.get("special", []):
            assert type(s["value"]) is JSON_TYPE[p.type], d["key"]
        for c in d.get("choices", []):
            assert set(c) == {"value", "label"}
        for s in d.get("switches", []):
            assert set(s) <= {"flag", "value", "deprecated"}


def test_describe_omits_absent_optionals() -> None:
    model = params.describe(True)[0]
    assert model["group_read_only"] is True
    for field in ("switches", "choices", "min", "max", "unit", "typical", "special",
                  "lossy", "accepts_auto", "launch_only"):
        assert field not in model
    think = next(d for d in params.describe(True) if d["key"] == "think")
    assert "short" not in think and "group_read_only" not in think
    assert think["switches"] == [{"flag": "--no-think", "value": False}]


def test_describe_cache_mb_matches_the_spec_example() -> None:
    row = next(d for d in params.describe(True) if d["key"] == "cache-mb")
    example = {"key": "cache-mb", "label": "Expert cache", "type": "int", "group": "cache",
               "group_label": "Expert cache", "group_order": 5, "level": "basic",
               "form": True, "scope": "session", "flag": "--cache-mb", "min": 0,
               "unit": "MiB", "typical": {"min": 1500, "max": 8192},
               "special": [{"value": 0, "label": "off"}], "accepts_auto": True,
               "default": "auto"}
    assert {k: row[k] for k in example} == example
    assert "max" not in row
    assert next(d for d in params.describe(False) if d["key"] == "cache-mb")["default"] == 0


# --- parse_value --------------------------------------------------------------------

@pytest.mark.parametrize(("key", "raw", "expected"), [
    ("ctx-size", "8192", 8192), ("ctx-size", 8192, 8192), ("ctx-size", 8192.0, 8192),
    ("temp", "0.7", 0.7), ("temp", 1, 1.0), ("top-p", 0.5, 0.5),
    ("think", "false", False), ("think", True, True), ("o-direct", "off", False),
    ("cache-mb", "auto", "auto"), ("cache-mb", "AUTO", "auto"), ("cache-mb", "0", 0),
    ("dense-weights", "mmap", "mmap"), ("model", "/m/x.gguf", "/m/x.gguf"),
    ("seed", 4294967295, 4294967295), ("n-predict", 0, 0),
])
def test_parse_value_accepts(key: str, raw: Any, expected: Any) -> None:
    value = params.parse_value(params.param(key), raw)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(("key", "raw", "reason"), [
    ("ctx-size", "lots", "whole number"), ("ctx-size", 1.5, "whole number"),
    ("ctx-size", True, "whole number"), ("ctx-size", None, "whole number"),
    ("ctx-size", 0, "between 1 and 1048576"), ("ctx-size", 1 << 21, "between"),
    ("n-predict", -2, "between -1 and"), ("temp", 2.5, "between 0.0 and 2.0"),
    ("temp", "nan", "a number"), ("temp", "inf", "a number"), ("temp", [1], "a number"),
    ("top-p", -0.1, "between"), ("io-threads", 9, "between 1 and 8"),
    ("seed", 4294967296, "between"), ("cache-floor-mb", -1, "at least 0 MiB"),
    ("threads", "auto", "whole number, not"), ("temp", "auto", "a number, not"),
    ("think", 1, "true or false"), ("think", "maybe", "true or false"),
    ("dense-weights", "warm", "one of mmap, anon"), ("dense-weights", 1, "one of"),
    ("model", 5, "must be text"), ("model", "a\0b", "NUL"),
])
def test_parse_value_refuses(key: str, raw: Any, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        params.parse_value(params.param(key), raw)
    message = str(info.value)
    assert message.startswith(f"{{{key}}} ") and reason in message


def test_only_accepts_auto_rows_take_auto() -> None:
    takers = []
    for p in ROWS:
        try:
            named_auto = any(c.value == "auto" for c in p.choices)   # a choice called auto
            if params.parse_value(p, "auto") == "auto" and p.type not in ("path", "text") \
                    and not named_auto:
                takers.append(p.key)
        except ValueError:
            pass
    assert takers == [p.key for p in ROWS if p.accepts_auto] == ["cache-mb"]


# --- validate and render ------------------------------------------------------------

def test_defaults_validate() -> None:
    assert params.validate(params.defaults(True)) == ""
    assert params.validate(params.defaults(False)) == ""


def test_validate_cache_above_ceiling() -> None:
    values = {**params.defaults(True), "cache-mb": 9000, "cache-ceil-mb": 8000}
    message = params.validate(values)
    assert "{cache-mb}" in message and "{cache-ceil-mb}" in message
    assert params.validate({**values, "cache-ceil-mb": 0}) == ""
    assert params.validate({**values, "cache-mb": "auto"}) == ""


def test_validate_reports_a_bad_value() -> None:
    assert params.validate({"temp": 7}).startswith("{temp} must be between")


def test_render_labels_and_flags() -> None:
    message = "{ctx-size} is too small for {n-predict}; {not-a-key} and {x y} stay"
    assert params.render(message) == (
        "Context is too small for Max tokens; {not-a-key} and {x y} stay")
    assert params.render(message, "flag") == (
        "--ctx-size is too small for --n-predict; {not-a-key} and {x y} stay")


# --- the command line ---------------------------------------------------------------

def test_no_flags_give_no_values() -> None:
    assert parse([]) == {}


@pytest.mark.parametrize("p", ROWS, ids=KEYS)
def test_every_flag_parses(p: Param) -> None:
    value = other_value(p)
    if p.type == "bool":
        assert parse([p.flag]) == {p.key: True}
        for s in p.switches:
            assert parse([s.flag]) == {p.key: s.value}
        return
    text = repr(value) if isinstance(value, float) else str(value)
    assert parse([p.flag, text]) == {p.key: value}
    assert parse([f"{p.flag}={text}"]) == {p.key: value}
    if p.short:
        assert parse([p.short, text]) == {p.key: value}


def test_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(argparse.ArgumentError) as info:
        parser().parse_args(["--ctx-size", "0"])
    assert "--ctx-size must be between 1 and 1048576" in str(info.value)


def test_last_of_a_flag_and_its_switch_wins() -> None:
    assert parse(["--think", "--no-think"]) == {"think": False}
    assert parse(["--no-odirect", "--o-direct"]) == {"o-direct": True}


def test_help_renders_for_both_programs() -> None:
    server_help = " ".join(parser(server=True).format_help().split())
    cli_help = " ".join(parser().format_help().split())
    line = "--cache-mb N|auto The memory that keeps experts once read. (default: {})"
    assert line.format("auto") in server_help
    assert line.format("0") in cli_help


@pytest.mark.parametrize("server", [False, True])
def test_to_args_round_trips_defaults(server: bool) -> None:
    values = params.defaults(server)
    args = params.to_args(values, KEYS)
    assert parse(args, server) == values


def test_to_args_round_trips_other_values() -> None:
    values = {p.key: other_value(p) for p in ROWS}
    assert parse(params.to_args(values, KEYS)) == values


def test_to_args_writes_only_the_keys_asked_in_table_order() -> None:
    values = {**params.defaults(True), "threads": 8, "model": "/m/a.gguf"}
    args = params.to_args(values, ["cache-mb", "moe-stream", "threads", "model"])
    assert args == ["--model", "/m/a.gguf", "--threads", "8", "--moe-stream",
                    "--cache-mb", "auto"]


def test_to_args_bools_use_the_negative_switch() -> None:
    values = {"think": False, "o-direct": False, "moe-stream": False}
    args = params.to_args(values, list(values))
    assert args == ["--no-think", "--no-moe-stream", "--no-odirect"]
    assert parse(args) == values


def test_to_args_value_that_looks_like_a_flag() -> None:
    values = {"model": "-weird.gguf"}
    args = params.to_args(values, ["model"])
    assert args == ["--model=-weird.gguf"]
    assert parse(args) == values


def test_to_args_keeps_float_precision() -> None:
    values = {"temp": 0.1 + 0.2, "top-p": 0.95}
    assert parse(params.to_args(values, list(values))) == values


@pytest.mark.parametrize("raw,reason", [
    ("[1, 2]", "must be a JSON object such as {\"enable_thinking\": false}, not a JSON list"),
    ("{enable_thinking: false}", "it is not JSON (line 1, column 2)"),
    ('"x"', "not a JSON string"),
    ('{"messages": []}', "cannot set messages: the server gives the template those itself"),
    ('{"k": "' + "x" * 70000 + '"}', "the limit is 65,536"),
])
def test_chat_template_kwargs_are_a_bounded_json_object(raw: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        params.parse_value(params.param("chat-template-kwargs"), raw)
    assert reason in str(info.value) and "{chat-template-kwargs}" in str(info.value)


def test_chat_template_kwargs_reach_the_template() -> None:
    """The setting's variables under the request's own; enable_thinking false is off."""
    from types import SimpleNamespace

    from bmoe.engine.params import template_kwargs
    from bmoe.engine.turn import TurnRequest, template_variables
    assert params.parse_value(params.param("chat-template-kwargs"), " ") == " "
    assert template_kwargs("") == {}
    own = template_kwargs('{"enable_thinking": false, "thinking_budget": 512, "x": 1}')
    session = SimpleNamespace(template_kwargs=own)
    req = TurnRequest(messages=[{"role": "user", "content": "hi"}], template_kwargs={"x": 2})
    think, variables = template_variables(session, req)  # type: ignore[arg-type]
    assert think is False
    assert variables == {"enable_thinking": False, "thinking_budget": 512, "x": 2}
    think, _ = template_variables(SimpleNamespace(template_kwargs={}), req)  # type: ignore[arg-type]
    assert think is True

"""ConfigStore: layering, reset, persistence, the settings file, model confinement."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from bmoe.engine import params
from bmoe.runtime.config import ConfigStore, OutsideModelsDir, confine_model_path
from bmoe.runtime import config

SERVER_DEFAULTS = params.defaults(server=True)


def put(store: ConfigStore, values: dict[str, Any] | None = None,
        reset: list[str] | None = None, *, local: bool = True,
        model_dirs: list[Path] | None = None, **kw: Any
        ) -> tuple[dict[str, Any], dict[str, config.Rejection]]:
    return store.put(values or {}, reset or [], peer_is_local=local,
                     model_dirs=model_dirs or [], **kw)


def saved(data_dir: Path) -> dict[str, Any]:
    return json.loads((data_dir / "settings.json").read_text())


# --- state and layering -------------------------------------------------------------

def test_fresh_store_follows_server_defaults(tmp_path: Path) -> None:
    state = ConfigStore(tmp_path, {}).state()
    assert state == {
        "values": SERVER_DEFAULTS, "user_keys": [], "launch_keys": [],
        "args": ["--n-predict", "0", "--ctx-size", "16384", "--moe-stream",
                 "--cache-mb", "auto", "--decide"],
        "valid": True, "error": "", "reload_required": False, "reload_keys": [],
        "plan": None, "auto_plan": True}
    assert list(state["values"]) == [p.key for p in params.table()]
    assert not (tmp_path / "settings.json").exists()


def test_layers_default_saved_launch_client(tmp_path: Path) -> None:
    put(ConfigStore(tmp_path, {}), {"threads": 3, "temp": 0.5, "top-k": 7})
    store = ConfigStore(tmp_path, {"threads": 5, "ctx-size": 8192})
    values = store.values
    assert (values["threads"], values["ctx-size"], values["temp"]) == (5, 8192, 0.5)
    assert values["io-threads"] == SERVER_DEFAULTS["io-threads"]
    put(store, {"threads": 6})
    assert store.values["threads"] == 6
    assert store.user_keys == ["ctx-size", "threads", "temp", "top-k"]


def test_user_keys_args_in_table_order(tmp_path: Path) -> None:
    store = ConfigStore(tmp_path, {"model": "/m/a.gguf"})
    state, rejected = put(store, {"cache-mb": "auto", "moe-stream": True, "threads": 8})
    assert rejected == {}
    assert state["user_keys"] == ["model", "threads", "moe-stream", "cache-mb"]
    assert state["launch_keys"] == ["model"]
    assert state["args"] == ["--model", "/m/a.gguf", "--n-predict", "0", "--ctx-size",
                             "16384", "--threads", "8", "--moe-stream", "--cache-mb",
                             "auto", "--decide"]


def test_args_are_the_equivalent_cli_command_line(tmp_path: Path) -> None:
    """bmoe-cli given ``args`` runs with exactly the server's values."""
    store = ConfigStore(tmp_path, {"ctx-size": 2048})
    state, _ = put(store, {"think": False, "temp": 0.7, "dense-weights": "mmap",
                           "moe-stream": False, "n-predict": 128})
    ap = argparse.ArgumentParser(exit_on_error=False)
    params.add_cli_flags(ap, server=False)
    parsed = params.values_from_namespace(ap.parse_args(state["args"]))
    assert {**params.defaults(server=False), **parsed} == state["values"]
    assert set(state["user_keys"]) <= set(parsed)
    assert parsed["moe-stream"] is False and parsed["n-predict"] == 128


def test_reset_returns_to_the_server_default(tmp_path: Path) -> None:
    store = ConfigStore(tmp_path, {"ctx-size": 8192})
    put(store, {"threads": 3, "temp": 0.4})
    state, rejected = put(store, reset=["threads", "ctx-size"])
    assert rejected == {}
    assert state["values"]["threads"] == SERVER_DEFAULTS["threads"]
    assert state["values"]["ctx-size"] == SERVER_DEFAULTS["ctx-size"]
    assert state["user_keys"] == ["temp"] and state["launch_keys"] == []
    assert saved(tmp_path)["values"] == {"temp": 0.4}


def test_set_then_reset_in_one_put(tmp_path: Path) -> None:
    state, _ = put(ConfigStore(tmp_path, {}), {"temp": 0.3}, ["temp"])
    assert state["values"]["temp"] == SERVER_DEFAULTS["temp"]
    assert state["user_keys"] == []


def test_client_value_replaces_the_launch_flag(tmp_path: Path) -> None:
    store = ConfigStore(tmp_path, {"ctx-size": 8192})
    state, _ = put(store, {"ctx-size": 2048})
    assert state["values"]["ctx-size"] == 2048
    assert state["user_keys"] == ["ctx-size"] and state["launch_keys"] == []
    assert saved(tmp_path)["values"] == {"ctx-size": 2048}


def test_bad_values_are_rejected_and_not_stored(tmp_path: Path) -> None:
    store = ConfigStore(tmp_path, {})
    state, rejected = put(store, {"ctx-size": "huge", "temp": 0.2, "nope": 1},
                          ["also-nope"])
    assert set(rejected) == {"ctx-size", "nope", "also-nope"}
    assert rejected["ctx-size"].startswith("Context must be a whole number")
    assert rejected["ctx-size"].code == "invalid_value"
    assert rejected["nope"].code == "unknown_param"
    assert json.loads(json.dumps(rejected))["ctx-size"] == rejected["ctx-size"]
    assert state["values"]["ctx-size"] == SERVER_DEFAULTS["ctx-size"]
    assert state["user_keys"] == ["temp"]


def test_invalid_config_is_stored_and_reported_with_labels(tmp_path: Path) -> None:
    state, rejected = put(ConfigStore(tmp_path, {}),
                          {"cache-mb": 9000, "cache-ceil-mb": 8000})
    assert rejected == {}
    assert state["valid"] is False
    assert state["error"].startswith("Expert cache is 9000 MiB, above Cache: ceiling")
    assert "{" not in state["error"]
    assert saved(tmp_path)["values"] == {"cache-mb": 9000, "cache-ceil-mb": 8000}


def test_launch_only_rows_are_refused_over_the_api(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    row = dataclasses.replace(params.param("model"), launch_only=True)
    real = params.param
    monkeypatch.setattr(params, "param", lambda k: row if k == "model" else real(k))
    store = ConfigStore(tmp_path, {"model": "/launch/a.gguf"})
    state, rejected = put(store, {"model": "/x.gguf"}, ["model"])
    assert rejected["model"].code == "launch_only"
    assert state["values"]["model"] == "/launch/a.gguf"
    assert state["launch_keys"] == ["model"]


def test_body_of_the_wrong_type(tmp_path: Path) -> None:
    store = ConfigStore(tmp_path, {})
    with pytest.raises(TypeError):
        store.put([1], [], peer_is_local=True, model_dirs=[])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.put({}, "temp", peer_is_local=True, model_dirs=[])
    with pytest.raises(TypeError):
        store.put({}, [3], peer_is_local=True, model_dirs=[])  # type: ignore[list-item]


def test_reload_keys_are_session_scoped_changes(tmp_path: Path) -> None:
    store = ConfigStore(tmp_path, {})
    loaded = store.values
    state, _ = put(store, {"n-predict": 50, "think": False, "ctx-size": 2048,
                           "threads": 1}, loaded_values=loaded)
    assert state["reload_required"] is True
    assert state["reload_keys"] == ["ctx-size", "threads"]
    assert store.state(None)["reload_keys"] == []
    state, _ = put(store, reset=["ctx-size", "threads"], loaded_values=loaded)
    assert (state["reload_required"], state["reload_keys"]) == (False, [])


# --- persistence --------------------------------------------------------------------

def test_values_survive_a_restart(tmp_path: Path) -> None:
    put(ConfigStore(tmp_path, {}), {"threads": 3, "cache-mb": "auto", "think": False})
    store = ConfigStore(tmp_path, {})
    assert store.user_keys == ["think", "threads", "cache-mb"]
    assert store.launch_keys == []
    values = store.values
    assert (values["threads"], values["cache-mb"], values["think"]) == (3, "auto", False)


def test_launch_values_are_not_saved(tmp_path: Path) -> None:
    store = ConfigStore(tmp_path, {"ctx-size": 8192, "model": "/m/a.gguf"})
    put(store, {"temp": 0.5})
    data = saved(tmp_path)
    assert data["values"] == {"temp": 0.5} and data["user_keys"] == ["temp"]
    assert ConfigStore(tmp_path, {}).values["ctx-size"] == SERVER_DEFAULTS["ctx-size"]


def test_launch_flag_outranks_saved_but_keeps_it(tmp_path: Path) -> None:
    put(ConfigStore(tmp_path, {}), {"ctx-size": 2048, "temp": 0.5})
    store = ConfigStore(tmp_path, {"ctx-size": 8192})
    assert store.values["ctx-size"] == 8192 and store.launch_keys == ["ctx-size"]
    put(store, {"threads": 2})  # a save in a run with the flag keeps the saved value
    assert saved(tmp_path)["values"] == {"ctx-size": 2048, "threads": 2, "temp": 0.5}
    assert ConfigStore(tmp_path, {}).values["ctx-size"] == 2048


def test_file_keeps_fields_it_does_not_own(tmp_path: Path) -> None:
    (tmp_path / "settings.json").write_text(json.dumps(
        {"version": 1, "values": {"temp": 0.5}, "auto_plan": False}))
    put(ConfigStore(tmp_path, {}), {"threads": 2})
    assert saved(tmp_path)["auto_plan"] is False


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    store = ConfigStore(data_dir, {})
    for n in range(1, 6):
        put(store, {"threads": n})
    assert os.listdir(data_dir) == ["settings.json"]
    assert saved(data_dir)["values"] == {"threads": 5}


def test_failed_write_keeps_the_old_file_and_the_value(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    store = ConfigStore(tmp_path, {})
    put(store, {"threads": 2})

    def refuse(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", refuse)
    # a change that cannot be saved is refused whole (the route answers 507), so what the
    # server holds is what a restart finds: nothing it acknowledged is lost (issue 35)
    with pytest.raises(OSError) as err:
        put(store, {"threads": 3})
    assert err.value.errno == 28 and err.value.filename == str(tmp_path / "settings.json")
    assert store.state()["values"]["threads"] == 2
    assert os.listdir(tmp_path) == ["settings.json"]
    assert saved(tmp_path)["values"] == {"threads": 2}


@pytest.mark.parametrize("content", [
    b"{not json", b"[1, 2]", b'{"values": [1]}', b"\xff\xfe\x00garbage"])
def test_corrupt_file_is_moved_aside(tmp_path: Path, content: bytes,
                                     caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "settings.json").write_bytes(content)
    with caplog.at_level(logging.WARNING):
        store = ConfigStore(tmp_path, {"threads": 2})
    assert "moved it to" in caplog.text
    assert (tmp_path / "settings.json.bad").read_bytes() == content
    assert not (tmp_path / "settings.json").exists()
    assert store.values == {**SERVER_DEFAULTS, "threads": 2}
    put(store, {"temp": 0.5})
    assert saved(tmp_path)["values"] == {"temp": 0.5}


def test_bad_saved_values_are_dropped_one_by_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "settings.json").write_text(json.dumps(
        {"values": {"temp": 9, "gone-param": 1, "threads": 3}}))
    with caplog.at_level(logging.WARNING):
        store = ConfigStore(tmp_path, {})
    assert store.user_keys == ["threads"]
    assert "Temperature must be between" in caplog.text and "gone-param" in caplog.text
    assert not (tmp_path / "settings.json.bad").exists()


def test_forget_missing_model(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    store = ConfigStore(tmp_path / "data", {})
    put(store, {"model": str(model)})
    assert store.forget_missing_model() is False
    model.unlink()
    assert store.forget_missing_model() is True
    assert store.values["model"] == "" and store.user_keys == []
    assert "model" not in saved(tmp_path / "data")["values"]
    launched = ConfigStore(tmp_path / "data", {"model": str(model)})
    assert launched.forget_missing_model() is False
    assert launched.values["model"] == str(model)


# --- model confinement --------------------------------------------------------------

@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    models, scan, outside = tmp_path / "models", tmp_path / "scan", tmp_path / "outside"
    for d in (models, scan, outside):
        d.mkdir()
    (models / "a.gguf").write_bytes(b"GGUF")
    (scan / "b.gguf").write_bytes(b"GGUF")
    (outside / "secret").write_bytes(b"x")
    (models / "link-out.gguf").symlink_to(outside / "secret")
    (outside / "link-in.gguf").symlink_to(models / "a.gguf")
    (models / "sub").symlink_to(outside, target_is_directory=True)
    return {"models": models, "scan": scan, "outside": outside}


def test_confine_accepts_paths_inside(dirs: dict[str, Path]) -> None:
    folders = [dirs["models"], dirs["scan"]]
    real_models = Path(os.path.realpath(dirs["models"]))
    assert confine_model_path("a.gguf", folders) == real_models / "a.gguf"
    assert confine_model_path(dirs["scan"] / "b.gguf", folders) == \
        Path(os.path.realpath(dirs["scan"])) / "b.gguf"
    assert confine_model_path(dirs["models"] / "x" / ".." / "a.gguf", folders) == \
        real_models / "a.gguf"
    assert confine_model_path(dirs["outside"] / "link-in.gguf", folders) == \
        real_models / "a.gguf"


@pytest.mark.parametrize("name", [
    "../outside/secret", "link-out.gguf", "sub/secret", "/etc/passwd", ".", "",
    "{models}/../outside/secret"])
def test_confine_refuses_paths_outside(dirs: dict[str, Path], name: str) -> None:
    path = name.replace("{models}", str(dirs["models"]))
    with pytest.raises(OutsideModelsDir) as info:
        confine_model_path(path, [dirs["models"], dirs["scan"]])
    assert isinstance(info.value, ValueError) and info.value.code == "outside_models_dir"


def test_confine_with_no_folders() -> None:
    with pytest.raises(OutsideModelsDir):
        confine_model_path("/m/a.gguf", [])


def test_network_client_model_is_confined(tmp_path: Path, dirs: dict[str, Path]) -> None:
    store = ConfigStore(tmp_path / "data", {})
    folders = [dirs["models"], dirs["scan"]]
    state, rejected = put(store, {"model": "../outside/secret", "temp": 0.5},
                          local=False, model_dirs=folders)
    assert rejected["model"].code == "outside_models_dir"
    assert rejected["model"].startswith("Model file:")
    assert state["values"]["model"] == "" and state["user_keys"] == ["temp"]
    state, rejected = put(store, {"model": "a.gguf"}, local=False, model_dirs=folders)
    assert rejected == {}
    assert state["values"]["model"] == os.path.realpath(dirs["models"] / "a.gguf")
    state, rejected = put(store, {"model": ""}, local=False, model_dirs=folders)
    assert rejected == {} and state["values"]["model"] == ""


def test_local_client_may_open_anywhere_unless_models_only(
        tmp_path: Path, dirs: dict[str, Path]) -> None:
    store = ConfigStore(tmp_path / "data", {})
    secret = str(dirs["outside"] / "secret")
    state, rejected = put(store, {"model": secret}, model_dirs=[dirs["models"]])
    assert rejected == {} and state["values"]["model"] == secret
    state, rejected = put(store, {"model": str(dirs["models"] / "link-out.gguf")},
                          model_dirs=[dirs["models"]], models_only=True)
    assert rejected["model"].code == "outside_models_dir"
    assert state["values"]["model"] == secret


def test_launch_model_is_not_confined(tmp_path: Path, dirs: dict[str, Path]) -> None:
    store = ConfigStore(tmp_path / "data", {"model": "/anywhere/m.gguf"})
    assert store.values["model"] == "/anywhere/m.gguf"

"""The server's config: layered values, who set them, and ``settings.json``.

Theory of operation
-------------------
A value comes from one of four layers, each over the one before:

1. the server's default (``params.defaults(server=True)``);
1b. the applied plan's values (``POST /api/plan/apply``; saved as ``plan`` in the file):
   never a key of ``user_keys``, and replaced whole by the next plan applied;
2. what a client saved in an earlier run (``<data_dir>/settings.json``);
3. the flags the server was launched with;
4. what a client sets while this run goes on (``PUT /api/config``).

Layers 2 and 4 are one dict, ``_client``: a value a client sets replaces the saved one,
is saved itself, and from then on outranks the launch flag for its key (the key leaves
``launch_keys``). ``_outranked`` holds the saved keys a launch flag hides this run, so
the flag wins at start while the saved value stays on disk for a run without the flag.
A reset returns a key to the server default: it leaves every layer, and ``user_keys``.

Launch values are never written to disk. The file is written atomically (a temp file in
the same folder, fsync, ``os.replace``). A settings file that cannot be read as ours is
moved aside to ``settings.json.bad`` with a warning; a saved value the table no longer
accepts is dropped with a warning. Neither stops the server.

The methods are plain and guarded by one lock: call them from any thread; they do the
file write inline, so an async caller runs ``put`` in a worker thread.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping

from bmoe import atomicfile
from bmoe.engine import params

log = logging.getLogger(__name__)

SETTINGS_FILE = "settings.json"
SETTINGS_VERSION = 1
AUTO_PLAN_DEFAULT = True    # every load plans first, unless the person turned it off


def default_data_dir() -> Path:
    """`--data-dir`'s default: $XDG_DATA_HOME/bmoe, or ~/.local/share/bmoe."""
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "bmoe"


class OutsideModelsDir(ValueError):
    """A model path a client named resolves outside every folder models are listed from."""

    status = 403
    code = "outside_models_dir"


class Rejection(str):
    """The reason one value was refused: a plain string in JSON, with a ``code``."""

    code: str

    def __new__(cls, reason: str, code: str = "invalid_value") -> Rejection:
        self = super().__new__(cls, reason)
        self.code = code
        return self


def confine_model_path(path: str | os.PathLike[str], model_dirs: list[Path]) -> Path:
    """``path`` made canonical and checked to lie inside one of ``model_dirs``.

    Every ``..`` and symbolic link is resolved; a relative path is taken inside the first
    models folder. Raises ``OutsideModelsDir`` when it resolves anywhere else.
    """
    if not model_dirs:
        raise OutsideModelsDir("no folder to list models from is set")
    given = Path(path)
    if not given.is_absolute():
        given = Path(model_dirs[0]) / given
    real = Path(os.path.realpath(given))
    for folder in model_dirs:
        root = Path(os.path.realpath(folder))
        if real != root and real.is_relative_to(root):
            return real
    raise OutsideModelsDir(f"{os.fspath(path)!r} is not inside a models folder")


class ConfigStore:
    def __init__(self, data_dir: Path, launch_values: Mapping[str, Any]) -> None:
        self._path = Path(data_dir) / SETTINGS_FILE
        self._lock = threading.RLock()
        self._launch = {k: params.parse_value(params.param(k), v)
                        for k, v in launch_values.items()}
        self._client: dict[str, Any] = {}
        self._extra: dict[str, Any] = {}     # other top-level fields of the file, kept
        self._plan: dict[str, Any] = {}      # the applied plan's values (the plan layer)
        self._plan_decisions: list[Any] | None = None
        self.auto_plan_launch: bool | None = None   # --auto / --no-auto, for this run
        self._auto_put = False
        self._load()
        self._load_plan()
        self._outranked = {k: v for k, v in self._client.items() if k in self._launch}
        for key in self._outranked:
            del self._client[key]

    # --- reading ------------------------------------------------------------------

    @property
    def values(self) -> dict[str, Any]:
        """Every parameter's current value, in table order."""
        with self._lock:
            merged = params.defaults(server=True)
            merged.update(self._plan)
            merged.update(self._outranked)
            merged.update(self._launch)
            merged.update(self._client)
            return merged

    @property
    def values_without_plan(self) -> dict[str, Any]:
        """What a plan is made from: defaults, launch flags and the person's values."""
        with self._lock:
            merged = params.defaults(server=True)
            merged.update(self._outranked)
            merged.update(self._launch)
            merged.update(self._client)
            return merged

    @property
    def auto_plan(self) -> bool:
        """Whether a load plans first: ``--auto``/``--no-auto`` for this run, unless a
        client chose since; else the saved choice; else ``AUTO_PLAN_DEFAULT``."""
        with self._lock:
            if self.auto_plan_launch is not None and not self._auto_put:
                return self.auto_plan_launch
            saved = self._extra.get("auto_plan")
            return saved if isinstance(saved, bool) else AUTO_PLAN_DEFAULT

    def set_auto_plan(self, on: bool) -> None:
        """``PUT /api/config`` with ``auto_plan``: saved, and over the launch flag."""
        with self._lock:
            self._extra["auto_plan"] = bool(on)
            self._auto_put = True
            self._save()

    def apply_plan(self, values: Mapping[str, Any], decisions: list[Any]) -> None:
        """The plan layer: ``values`` replace the previous plan's whole; saved."""
        with self._lock:
            kept: dict[str, Any] = {}
            for key, value in values.items():
                p = _known(key)
                if p is None or p.launch_only:
                    continue
                try:
                    kept[key] = params.parse_value(p, value)
                except ValueError:
                    continue
            self._plan = kept
            self._plan_decisions = list(decisions)
            self._extra["plan"] = {"values": kept, "decisions": self._plan_decisions}
            self._save()

    def _load_plan(self) -> None:
        saved = self._extra.get("plan")
        if not isinstance(saved, dict):
            self._extra.pop("plan", None)
            return
        values, decisions = saved.get("values"), saved.get("decisions")
        if isinstance(values, dict):
            self._plan = _saved_values(values, self._path)
        self._plan_decisions = decisions if isinstance(decisions, list) else None

    @property
    def user_keys(self) -> list[str]:
        with self._lock:
            return _in_table_order(set(self._launch) | set(self._client))

    @property
    def launch_keys(self) -> list[str]:
        with self._lock:
            return _in_table_order(self._launch)

    def state(self, loaded_values: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The object of ``GET /api/config``. ``loaded_values``: the session's, or None."""
        with self._lock:
            values, user_keys = self.values, self.user_keys
            error = params.validate(values)
            reload_keys = _reload_keys(values, loaded_values)
            return {
                "values": values, "user_keys": user_keys, "launch_keys": self.launch_keys,
                "args": params.to_args(values, _cli_keys(values, user_keys)),
                "valid": not error,
                "error": params.render(error, "label"),
                "reload_required": bool(reload_keys), "reload_keys": reload_keys,
                "plan": self._plan_decisions, "auto_plan": self.auto_plan}

    # --- changing -----------------------------------------------------------------

    def put(self, values: Mapping[str, Any], reset: Iterable[str], *,
            peer_is_local: bool, model_dirs: list[Path], models_only: bool = False,
            loaded_values: Mapping[str, Any] | None = None,
            ) -> tuple[dict[str, Any], dict[str, Rejection]]:
        """Set ``values``, then reset the keys in ``reset`` to the server default.

        Returns the new ``state()`` and the refused entries, ``{key: reason}``; a refused
        value changes nothing. A config that fails ``validate()`` is still stored.
        ``TypeError`` when ``values`` is not a mapping or ``reset`` holds a non-string.
        """
        values, reset = _checked_body(values, reset)
        confine = models_only or not peer_is_local
        with self._lock:
            before = (dict(self._client), dict(self._outranked))
            rejected: dict[str, Rejection] = {}
            changed = False
            for key, raw in values.items():
                problem = self._set(key, raw, model_dirs if confine else None)
                changed |= problem is None
                if problem is not None:
                    rejected[key] = problem
            for key in reset:
                problem = self._reset(key)
                changed |= problem is None
                if problem is not None:
                    rejected[key] = problem
            if changed:
                try:
                    self._save(strict=True)
                except OSError:
                    # not kept on disk: not kept at all, so the answer (an error) is true
                    self._client, self._outranked = before
                    raise
            return self.state(loaded_values), rejected

    def extra(self, key: str) -> Any:
        """A top-level field of the settings file that is not a parameter (``model_folders``)."""
        with self._lock:
            return self._extra.get(key)

    def set_extra(self, key: str, value: Any) -> None:
        with self._lock:
            self._extra[key] = value
            self._save()

    def forget_missing_model(self) -> bool:
        """Forget a client's model whose file is gone (a launch ``-m`` stays).

        Call at start and after a model is deleted. True when the model was forgotten.
        """
        with self._lock:
            model = self._client.get("model")
            if not model or os.path.exists(model):
                return False
            del self._client["model"]
            self._save()
            return True

    def _set(self, key: str, raw: Any, model_dirs: list[Path] | None) -> Rejection | None:
        p = _known(key)
        if p is None:
            return Rejection(f"{key!r} is not a setting", "unknown_param")
        if p.launch_only:
            return Rejection(f"{p.label} is set when the server starts, not over the API",
                             "launch_only")
        try:
            value = params.parse_value(p, raw)
            if key in ("model", "mmproj") and value and model_dirs is not None:
                value = os.fspath(confine_model_path(value, model_dirs))
        except OutsideModelsDir as e:
            return Rejection(f"{p.label}: {e}", e.code)
        except ValueError as e:
            return Rejection(params.render(str(e), "label"))
        self._launch.pop(key, None)
        self._outranked.pop(key, None)
        self._client[key] = value
        return None

    def _reset(self, key: str) -> Rejection | None:
        p = _known(key)
        if p is None:
            return Rejection(f"{key!r} is not a setting", "unknown_param")
        if p.launch_only:
            return Rejection(f"{p.label} is set when the server starts, not over the API",
                             "launch_only")
        for layer in (self._client, self._launch, self._outranked):
            layer.pop(key, None)
        return None

    # --- the file -----------------------------------------------------------------

    def _load(self) -> None:
        try:
            text = self._path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as e:
            self._set_aside(f"cannot be read ({e})")
            return
        try:
            data = json.loads(text)
        except ValueError as e:
            self._set_aside(f"is not JSON ({e})")
            return
        if not isinstance(data, dict) or not isinstance(data.get("values", {}), dict):
            self._set_aside("is not a settings object")
            return
        self._client = _saved_values(data.get("values", {}), self._path)
        self._extra = {k: v for k, v in data.items()
                       if k not in ("version", "values", "user_keys")}

    def _set_aside(self, why: str) -> None:
        bad = self._path.with_name(self._path.name + ".bad")
        try:
            os.replace(self._path, bad)
        except OSError as e:
            log.warning("settings: %s %s and could not be moved aside (%s); "
                        "starting from the defaults", self._path, why, e)
            return
        log.warning("settings: %s %s; moved it to %s and started from the defaults",
                    self._path, why, bad)

    def _document(self) -> dict[str, Any]:
        saved = {**self._outranked, **self._client}
        ordered = {k: saved[k] for k in _in_table_order(saved)}
        return {**self._extra, "version": SETTINGS_VERSION, "values": ordered,
                "user_keys": list(ordered)}

    def _save(self, strict: bool = False) -> None:
        """Write the settings file; `strict` raises a failure (a full or read-only data
        folder) instead of logging it."""
        try:
            _write_atomically(self._path, json.dumps(self._document(), indent=2) + "\n")
        except OSError as e:
            if strict:
                raise
            log.warning("settings: could not save %s (%s); the change holds until "
                        "the server stops", self._path, e)


# --- helpers ----------------------------------------------------------------------------

def _known(key: str) -> params.Param | None:
    try:
        return params.param(key)
    except KeyError:
        return None


def _in_table_order(keys: Iterable[str]) -> list[str]:
    wanted = set(keys)
    return [p.key for p in params.table() if p.key in wanted]


def _cli_keys(values: Mapping[str, Any], user_keys: list[str]) -> list[str]:
    """The keys ``bmoe-cli`` needs to run as the server would: the operator's, and
    every one whose server value is not the CLI's default (streaming, cache, ...)."""
    cli = params.defaults(server=False)
    return [k for k in values if k in user_keys or values[k] != cli[k]]


def _reload_keys(values: Mapping[str, Any],
                 loaded: Mapping[str, Any] | None) -> list[str]:
    if loaded is None:
        return []
    return [p.key for p in params.table()
            if p.scope == "session" and loaded.get(p.key) != values[p.key]]


def _checked_body(values: Any, reset: Any) -> tuple[Mapping[str, Any], list[str]]:
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise TypeError("values must be an object of {key: value}")
    if isinstance(reset, (str, bytes)):
        raise TypeError("reset must be a list of setting keys")
    keys = list(reset or [])
    if not all(isinstance(k, str) for k in keys):
        raise TypeError("reset must be a list of setting keys")
    return values, keys


def _saved_values(raw: Mapping[str, Any], path: Path) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    for key, value in raw.items():
        p = _known(key)
        if p is None or p.launch_only:
            log.warning("settings: %s: dropped %r, which is not a setting", path, key)
            continue
        try:
            kept[key] = params.parse_value(p, value)
        except ValueError as e:
            log.warning("settings: %s: dropped %s", path, params.render(str(e), "label"))
    return kept


def _write_atomically(path: Path, text: str) -> None:
    atomicfile.write_text(path, text)

"""YAML/Hydra config -> typed `Config`, strictly: an unknown key or a wrong type fails at once,
naming the key, the value and the fix, before anything starts."""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any, Mapping

from .schema import Config, GroupConfig, renamed_keys_error


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key, the value and the fix."""


def _plain(obj: Any) -> Any:
    """OmegaConf containers -> plain dicts/lists (resolving ${...} interpolations)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover - hydra-core is a core dependency
        pass
    return obj


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(path: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _coerce(path, value, args[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}={value!r}: expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}={value!r}: expected a string")
    if tp is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise ConfigError(f"{path}={value!r}: expected a list, e.g. [a, b]")
    if tp is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise ConfigError(f"{path}={value!r}: expected a mapping")
    return value


def _first_non_finite(path: str, value: Any) -> tuple[str, float] | None:
    """The first nan/inf anywhere in `value` (list items, mapping values) and where it sits.

    Walking the value rather than only `float`-typed fields covers untyped containers too
    (`actor_config.betas`, `trainer.simulate_cost_s_per_row`, `placement.mfcs`), so a key added
    later cannot slip a nan past loading whatever its annotation.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    if isinstance(value, (list, tuple)):
        items: Any = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, Mapping):
        items = ((f"{path}.{k}", v) for k, v in value.items())
    else:
        return None
    for where, item in items:
        found = _first_non_finite(where, item)
        if found:
            return found
    return None


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _check_finite(path: str, value: Any, default: Any) -> None:
    """No config number may be nan, inf or -inf: none of them means anything a run can do (a timeout of
    inf would hand Ray an infinite wait, a learning rate of nan only fails when the model loads)."""
    found = _first_non_finite(path, value)
    if found:
        where, bad = found
        fix = "give a finite number" + (f" (the default: {path}={_yaml(default)})"
                                         if where == path or isinstance(default, list) else "")
        raise ConfigError(f"{where}={bad}: must be a finite number (nan, inf and -inf are not accepted for any key); "
                          f"{fix}; see docs/configs.md")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _section(path: str) -> str:
    return path[len("config."):] if path.startswith("config.") else path


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{_section(path)}={data!r}: expected a mapping of keys for section {_section(path)!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"{_section(path)}.{key}: unknown key{_suggest(key, list(fields))}; "
                              f"keys of {_section(path)} are {sorted(fields)} (see docs/configs.md)")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{_section(path)}.{key}")
        else:
            kwargs[key] = _coerce(f"{_section(path)}.{key}", value, tp)
            _check_finite(f"{_section(path)}.{key}", kwargs[key], _default(fields[key]))
    return cls(**kwargs)


def config_from_dict(data: Mapping[str, Any] | Any) -> Config:
    """Build the typed config; the `hydra` section (Hydra's own settings) is ignored."""
    data = _plain(data) or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: the top level must be a mapping of sections (trainer, actor_config, ...), "
                          f"got {type(data).__name__}")
    data = dict(data)
    data.pop("hydra", None)
    data.pop("defaults", None)
    renamed = renamed_keys_error(data)  # old size keys: say what they became, not "unknown key"
    if renamed:
        raise ConfigError(renamed)
    known = [f.name for f in dataclasses.fields(Config)]
    for key in data:
        if key not in known:
            raise ConfigError(f"{key}: unknown config section{_suggest(key, known)}; sections are {known} "
                              "(see docs/configs.md)")
    cfg = _build(Config, data, "config")
    groups = {}
    for name, g in cfg.placement.groups.items():
        groups[name] = _build(GroupConfig, g or {}, f"placement.groups.{name}")
    cfg.placement.groups = groups
    return cfg


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)

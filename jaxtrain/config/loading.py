"""Recipes (Python files defining get_config()), `section.key=value` overrides parsed by
the field's type, and copies derived from a validated config."""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import pathlib
import sys
import types
import typing
from typing import Any, Literal, get_args, get_origin

from jaxtrain.config.errors import ConfigError
from jaxtrain.config.sections import Config


def load_recipe(path: str | pathlib.Path) -> Config:
    """The Config of a recipe file. A recipe derives from its siblings with relative imports
    (`from . import llama3_base`): its folder is loaded as a package of its own, named after
    the folder's path, so two folders that both hold a `llama3_base.py` never share one."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file; recipes live in configs/*.py")
    folder = path.resolve().parent
    package = "jaxtrain_recipes_" + hashlib.sha1(str(folder).encode()).hexdigest()[:12]
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            package, folder / "__init__.py", submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module  # no __init__.py needed: nothing runs for the package
    module = importlib.import_module(f"{package}.{path.stem}")
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} defines no get_config(); a recipe must return a Config")
    cfg = module.get_config()
    if not isinstance(cfg, Config):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, not Config")
    return cfg


def load_config(path: str | pathlib.Path, overrides: typing.Sequence[str] = ()) -> Config:
    """Recipe file + `section.key=value` overrides, validated."""
    cfg = load_recipe(path)
    apply_overrides(cfg, overrides)
    return cfg.validate()


def derive(cfg: Config, *overrides: str) -> Config:
    """A validated copy of `cfg` with `section.key=value` overrides (the CLI's spelling)."""
    new = from_dict(cfg.to_dict())
    apply_overrides(new, overrides)
    return new.validate()


def from_dict(d: dict) -> Config:
    """Inverse of `Config.to_dict()` (reads a run's config.json)."""
    return _build(Config, d, "")


def _build(cls, d: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in hints:
            raise ConfigError(f"unknown key {prefix}{key}")
        tp = hints[key]
        inner = _unwrap_optional(tp)
        if dataclasses.is_dataclass(inner) and isinstance(value, dict):
            kwargs[key] = _build(inner, value, f"{prefix}{key}.")
        elif get_origin(inner) is tuple and isinstance(value, list):
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = value
    return cls(**kwargs)


# ----------------------------------------------------------------------------- overrides

def apply_overrides(cfg: Config, overrides: typing.Sequence[str]) -> Config:
    for item in overrides:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE, e.g. --train.steps=20")
        key, raw = item.split("=", 1)
        if key.startswith("config."):  # ml_collections habit: --config.train.steps=20
            key = key[len("config."):]
        set_value(cfg, key, raw)
    return cfg


def set_value(cfg: Config, dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    node: Any = cfg
    for depth, part in enumerate(parts):
        hints = typing.get_type_hints(type(node))
        where = ".".join(parts[:depth])
        if part not in hints:
            choices = sorted(hints)
            close = difflib.get_close_matches(part, choices, n=3)
            prefix = f"{where}." if where else ""
            hint = f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            raise ConfigError(
                f"unknown config key {dotted!r}{hint} "
                f"(keys of {where or 'the config'}: {', '.join(choices)})")
        tp = hints[part]
        if depth == len(parts) - 1:
            setattr(node, part, parse_value(dotted, raw, tp))
            return
        child = getattr(node, part)
        if child is None:  # an optional section (e.g. model.rope_scaling): create it
            child = _unwrap_optional(tp)()
            setattr(node, part, child)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"config key {'.'.join(parts[:depth + 1])!r} is a value, not a section")
        node = child


def _unwrap_optional(tp):
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def parse_value(key: str, raw: str, tp) -> Any:
    """Parse `raw` as the field type `tp`; errors name the key and what is allowed."""
    is_optional = type(None) in get_args(tp)
    tp = _unwrap_optional(tp)
    if is_optional and raw.lower() in ("none", "null", ""):
        return None
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if raw not in allowed:
            close = difflib.get_close_matches(raw, allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}={raw!r} is not allowed{hint}; choose one of {', '.join(allowed)}")
        return raw
    if tp is bool:
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r}: expected a boolean (true/false)")
    if tp is int:
        try:
            return int(raw.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key}={raw!r}: expected an integer") from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{key}={raw!r}: expected a number") from None
    if tp is str:
        return raw
    if origin is tuple:
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    if dataclasses.is_dataclass(tp):
        raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.{dataclasses.fields(tp)[0].name}=...")
    raise ConfigError(f"{key}: cannot parse a value of type {tp}")



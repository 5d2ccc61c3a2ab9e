"""Strict conversion of TOML and command-line values to a config field's type, and setting one key.

"ten" is not an int, 1.5 is not an int, `compile = "yes"` in a TOML file is a string; every mistake is a
ConfigError naming the key (`where`) and, for an unknown name, the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import fields
from typing import Any

from kiln_base.config.schema import JobConfig
from kiln_base.errors import ConfigError

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def convert(value: Any, tp: Any, where: str, toml: bool = False) -> Any:
    """Convert a TOML or CLI value to type `tp`, strictly: "ten" is not an int, 1.5 is not an int.

    From TOML (`toml`), booleans and numbers must be TOML's own: `compile = "yes"` or `steps = "10"` is a
    mistake (a quoted value is a string), while the command line, where everything is a string, may say
    `--training.compile true` or `--training.steps 10`.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return convert(value, inner, where, toml)
    if origin is list:
        (inner,) = args
        if isinstance(value, str):  # a list of lists on the command line: "a,b;c" is [["a", "b"], ["c"]]
            sep = ";" if typing.get_origin(inner) is list else ","
            value = [v.strip() for v in value.split(sep) if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [convert(v, inner, where, toml) for v in value]
    if dataclasses.is_dataclass(tp):
        return _convert_table(value, tp, where, toml)
    if toml and isinstance(value, str) and tp in (bool, int, float):
        kind = {bool: "boolean (true or false, unquoted)", int: "integer (unquoted)", float: "number (unquoted)"}
        raise ConfigError(f"{where}: expected a TOML {kind[tp]}, got the string {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise AssertionError(f"unsupported config type {tp} at {where}")


def _convert_table(value: Any, tp: Any, where: str, toml: bool) -> Any:
    """A list entry that is a small dataclass (training.dataset_mix's sources): a TOML table, strictly converted
    key by key and range-checked, or its command-line text (`tp.from_cli`)."""
    if isinstance(value, str) and not toml:
        out = tp.from_cli(value.strip(), where)
    elif isinstance(value, dict):
        hints = typing.get_type_hints(tp)
        unknown = [k for k in value if k not in hints]
        if unknown:
            raise ConfigError(f"{where}: unknown key '{unknown[0]}'{suggest(unknown[0], list(hints))}")
        out = tp(**{k: convert(v, hints[k], f"{where}.{k}", toml) for k, v in value.items()})
    else:
        raise ConfigError(f"{where}: expected a table ({', '.join(f.name for f in fields(tp))}), got {value!r}")
    for f in fields(out):
        valid, v = f.metadata.get("valid"), getattr(out, f.name)
        if valid is not None and v is not None and not valid.contains(v):
            raise ConfigError(f"{where}.{f.name} must be {valid.describe(v)}, got {v!r}")
    return out


def suggest(name: str, options: list[str]) -> str:
    """'; did you mean X?' with the closest option, or the list of options when none is close."""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(options)}"


def lookup(cfg: JobConfig, section: str, key: str, where: str) -> tuple[Any, Any]:
    """Return (section object, field type) for section.key, or raise with the closest valid name."""
    sections = [f.name for f in fields(JobConfig)]
    if section not in sections:
        raise ConfigError(f"{where}: unknown section '{section}'{suggest(section, sections)}")
    obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(obj))
    if key not in hints:
        full = [f"{section}.{k}" for k in hints]
        raise ConfigError(f"{where}: unknown key '{section}.{key}'{suggest(f'{section}.{key}', full)}")
    return obj, hints[key]


def set_value(cfg: JobConfig, section: str, key: str, raw: Any, where: str, toml: bool = False) -> None:
    """Convert `raw` to section.key's type, check its choices, set it."""
    obj, tp = lookup(cfg, section, key, where)
    one_str = tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp))
    if key.endswith("_path") and one_str and isinstance(raw, str) and not raw.strip():
        # convert() reads "" as unset: for a path that is an unset variable ($DATA), never a wish for the default
        raise ConfigError(f"{where} is empty: give a file or folder, or none to leave it unset")
    value = convert(raw, tp, where, toml)
    choices = next(f.metadata.get("choices") for f in fields(obj) if f.name == key)
    check_choice(value, choices, where, optional=type(None) in typing.get_args(tp))
    setattr(obj, key, value)


def check_choice(value: Any, choices: tuple[str, ...] | None, where: str, optional: bool = False) -> None:
    """A value of an enumerated key must be one of its choices (None, an unset optional key, is not checked;
    `optional`: the key also takes none, which the message then lists)."""
    if choices and value is not None and value not in choices:
        unset = " (or none)" if optional else ""
        raise ConfigError(f"{where}: '{value}' is not a valid choice; choose from {', '.join(choices)}{unset}")

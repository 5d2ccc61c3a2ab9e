"""Parsing: defaults < TOML file < command line, into one JobConfig; paths made absolute; printing it back.

The command line accepts `--section.key value`, `--section.key=value`, bare `--section.flag` (true) and
`--section.no-flag` (false), comma lists. torchtitan's key names are translated first (torchtitan_compat.py).
The config-only checks (checks.check_config_alone) run before parse_args returns.
"""

from __future__ import annotations

import os
import sys
import typing

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from dataclasses import fields
from typing import Any

from kiln_base.config.checks import check_config_alone
from kiln_base.config.schema import JobConfig
from kiln_base.config.torchtitan_compat import resolve as resolve_torchtitan_names
from kiln_base.config.values import lookup, set_value
from kiln_base.errors import ConfigError
from kiln_base.files import FileRefused, MiB, read_bounded, url_scheme

MAX_CONFIG_BYTES = 1 * MiB  # kiln's own configs are ~2 KB

# The kiln checkout (or editable install): where the default config and the bundled assets live.
KILN_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve_input_path(path: str) -> str:
    """An existing file the user names, as an absolute path.

    Relative paths are taken from the current directory (where the user launched kiln); when nothing is there
    but kiln's own folder has it, kiln's copy: the shipped configs name the bundled tokenizer and corpus as
    `assets/...`, and `CONFIG_FILE=train_configs/x.toml` works from any directory. The current directory wins
    when both exist; the start-up log prints the path chosen.
    """
    if url_scheme(path) is not None:  # a URL is never a local path (the config checks decide whether it is valid)
        return path
    path = os.path.expanduser(path)
    if os.path.isabs(path):
        return os.path.normpath(path)
    here = os.path.abspath(path)
    bundled = os.path.join(KILN_ROOT, path)
    return bundled if not os.path.exists(here) and os.path.exists(bundled) else here


def resolve_output_path(path: str) -> str:
    """A folder kiln writes to, as an absolute path: relative to the current directory, never kiln's. A URL stays
    as it is: made absolute, `s3://b/x` would be a local folder named `s3:`."""
    if url_scheme(path) is not None:
        return path
    return os.path.abspath(os.path.expanduser(path))


def _resolve_paths(cfg: JobConfig) -> None:
    """Make every user path absolute once, at parse time, so no later code depends on the current directory."""
    cfg.job.dump_folder = resolve_output_path(cfg.job.dump_folder)
    cfg.model.tokenizer_path = resolve_input_path(cfg.model.tokenizer_path)
    if cfg.training.dataset_path is not None:
        cfg.training.dataset_path = resolve_input_path(cfg.training.dataset_path)
    if cfg.validation.dataset_path is not None:
        cfg.validation.dataset_path = resolve_input_path(cfg.validation.dataset_path)
    for source in cfg.training.dataset_mix:
        source.path = resolve_input_path(source.path)
    # eval: folders of task files, and tasks given as YAML paths (names stay names)
    cfg.eval.include_path = [resolve_input_path(p) for p in cfg.eval.include_path]
    cfg.eval.tasks = [resolve_input_path(t) if t.endswith((".yaml", ".yml")) else t for t in cfg.eval.tasks]
    if cfg.checkpoint.initial_load_path is not None:
        cfg.checkpoint.initial_load_path = resolve_output_path(cfg.checkpoint.initial_load_path)


def _load_toml(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        raise ConfigError(f"--job.config_file {path} is a directory; give a TOML file")
    if not os.path.exists(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = read_bounded(path, MAX_CONFIG_BYTES, "a TOML config")
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except FileRefused as e:
        raise ConfigError(f"config file {e}") from None
    if raw.startswith(b"\xef\xbb\xbf"):  # TOML forbids a BOM; tomllib's own message would be "Invalid statement"
        raise ConfigError(f"{path}: starts with a UTF-8 byte-order mark (BOM); save the file as UTF-8 without BOM")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}); TOML files must be UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # message already carries "(at line N, column M)"
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    except RecursionError:  # 100,000 nested `[`: deeper than the parser recurses
        raise ConfigError(f"{path}: malformed TOML: arrays or tables nested deeper than kiln parses") from None


def _parse_cli(argv: list[str]) -> list[tuple[str, str, Any]]:
    """Split argv into (section, key, raw value) triples.

    Accepts `--s.k v`, `--s.k=v`, bare `--s.flag` (true) and `--s.no-flag` / `--s.no_flag` (false).
    Whether a bare flag is boolean is decided later, against the field's type.
    """
    out: list[tuple[str, str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}'; use --section.key value (see --help)")
        name, eq, text = arg[2:].partition("=")
        val: str | None = text
        section, _, key = name.partition(".")
        i += 1
        if not eq:
            if i < len(argv) and not argv[i].startswith("--"):
                val = argv[i]
                i += 1
            else:
                val = None  # bare flag: resolved against the field type below
        out.append((section, key.replace("-", "_") if key.startswith("no-") else key, val))
    return out


def _apply_cli(cfg: JobConfig, items: list[tuple[str, str, Any]]) -> None:
    for section, key, val in items:
        where = f"--{section}.{key}"
        negated = val is None and key.startswith("no_")
        if negated:
            key = key[3:]
        if val is None:
            obj, tp = lookup(cfg, section, key, where)
            if tp is not bool and negated:  # --s.no-k names a boolean's false; k takes a value instead
                raise ConfigError(
                    f"--{section}.no-{key}: {section}.{key} is not a boolean flag (only booleans have a --no- form); "
                    f"it takes {_takes(obj, key, tp)}: --{section}.{key} VALUE"
                )
            if tp is not bool:
                raise ConfigError(f"--{section}.{key}: needs a value")
            val = not negated
        set_value(cfg, section, key, val, f"--{section}.{key}")


def _takes(obj: Any, key: str, tp: Any) -> str:
    """What a non-boolean key takes, for a message: 'an integer >= 1', 'a string', 'a list'."""
    valid = next(f.metadata.get("valid") for f in fields(obj) if f.name == key)
    kinds = {int: "an integer", float: "a number", str: "a string"}
    kind = next((v for t, v in kinds.items() if tp is t or t in typing.get_args(tp)), "a value")
    if typing.get_origin(tp) is list or list in typing.get_args(tp):
        kind = "a list"
    return f"{kind} {valid.describe()}" if valid is not None else kind


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig: dataclass defaults < TOML file (--job.config_file) < CLI overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(format_help())
        raise SystemExit(0)
    items = _parse_cli(argv)
    cfg = JobConfig()
    # The last --job.config_file wins, like any key given twice: run_train.sh passes CONFIG_FILE first, so a
    # --job.config_file on its command line overrides it.
    config_file = next((v for s, k, v in reversed(items) if (s, k) == ("job", "config_file")), None)
    if config_file:
        given, config_file = config_file, resolve_input_path(config_file)
        if not os.path.isfile(config_file) and not os.path.isabs(os.path.expanduser(given)):
            raise ConfigError(
                f"config file not found: {given} (relative paths are looked up in the current directory "
                f"{os.getcwd()}, then in kiln's folder {KILN_ROOT})"
            )
    toml = _load_toml(config_file) if config_file else {}
    # torchtitan's key names (v0.1.0 .. v0.2.2) -> kiln's, before anything is set: see torchtitan_compat.py
    toml, items = resolve_torchtitan_names(toml, items, config_file)
    if config_file:
        for section, values in toml.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{config_file}: '{section}' must be a [section] table")
            for key, raw in values.items():
                set_value(cfg, section, key, raw, f"{config_file}: {section}.{key}", toml=True)
    _apply_cli(cfg, items)
    cfg.job.config_file = config_file or None
    _resolve_paths(cfg)
    check_config_alone(cfg)
    return cfg


# ----------------------------------------------------------------------------- output


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # a table in a list (training.dataset_mix): an inline table, unset keys left out
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    return repr(v)


def to_toml(cfg: JobConfig) -> str:
    """The merged config as TOML (keys set to None are written as comments: TOML has no null)."""
    lines: list[str] = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"# {k} = (unset)" if v is None else f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def format_help() -> str:
    """--help: every key with its default, choices and help text, by section."""
    lines = [
        "usage: train.py [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Precedence: defaults < TOML file < command line. Booleans: --s.flag, --s.no-flag, --s.flag=false.",
        "Lists: comma-separated (--float8.filter_fqns output,w2).",
    ]
    for sf in fields(JobConfig):
        lines.append(f"\n[{sf.name}]")
        factory = sf.default_factory
        assert callable(factory), sf.name  # every section is a default_factory field
        for f in fields(factory()):
            default = f.default_factory() if callable(f.default_factory) else f.default
            choices = f.metadata.get("choices")
            extra = f" {{{','.join(choices)}}}" if choices else ""
            lines.append(f"  --{sf.name}.{f.name}{extra}  (default: {default})\n      {f.metadata['help']}")
    return "\n".join(lines)

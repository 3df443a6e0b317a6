"""The text side of a config: ``-S`` overrides into a nested dict, and the one-line messages of
a config that does not validate (pydantic's, YAML's, and the refusals of settings a device or a
sharded model cannot honour).  Kept out of :mod:`training.config`, which holds the settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError


class ConfigError(ValueError):
    """A bad configuration; its message is a single line meant for the user."""


#: Refusals of settings a CPU or a sharded model cannot honour (one line each).
CPU_FLOAT16 = (
    "train.amp_dtype = 'float16' is not honoured on CPU (convoy's CPU autocast runs bfloat16); "
    "use train.amp_dtype: bfloat16 (or auto), or train.device: cuda"
)
EMA_FSDP = (
    "train.ema_decay is not supported with train.parallel: fsdp yet (each rank would hold the whole "
    "average); keep an EMA of your shards in TaskParts.extra_state, or use train.parallel: ddp"
)


def _parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected section.key=value, e.g. train.lr=3e-4")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` entries (values parsed as YAML scalars) into a nested dict."""
    for text in overrides:
        path, value = _parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line: where, which key, which value, what is allowed."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"].removeprefix("Value error, ")
    more = f" (and {len(exc.errors()) - 1} more error(s))" if len(exc.errors()) > 1 else ""
    if err["type"] == "extra_forbidden":
        return f"{source}: unknown key {loc!r}; remove it or check its spelling"
    if err["type"] == "value_error":  # our own validators already name the key and the value
        return f"{source}: {msg}{more}"
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f" = {value!r}"
    return f"{source}: {loc}{shown}: {msg}{more}"


def yaml_error_line(path: Path, exc: yaml.YAMLError) -> str:
    """``params.yaml:12:5: not valid YAML: <problem> (<context>)``: where an editor can jump."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")

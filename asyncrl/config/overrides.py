"""``--set a.b.c=VALUE``: one override applied to a raw (unvalidated) config mapping.

The path is checked against the schema as it is walked (a misspelt key names the closest
one), so a typo is an error before validation, never a silently ignored key.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Union

import yaml
from pydantic import BaseModel

from asyncrl.config.paths import child_annotation, closest_key, field_names_at, is_model, join_path, unwrap_optional
from asyncrl.errors import ConfigError


def _takes_raw_text(annotation: Any) -> bool:
    """True for fields whose values are plain strings (``str`` or a union led by str
    with nothing but models beside it): ``--set`` gives those the raw text."""
    annotation, _ = unwrap_optional(annotation)
    if annotation is str:
        return True
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = typing.get_args(annotation)
        return str in args and all(a is str or is_model(a) for a in args)
    return False


def apply_override(raw: dict, root: type[BaseModel], item: str) -> None:
    """Apply one ``a.b.c=VALUE`` override to the raw (unvalidated) config mapping.

    VALUE is parsed as YAML, except that a field of type ``str`` takes the raw text
    (YAML 1.1 would turn ``no`` into false and ``0123`` into 83); ``null`` still means
    None where the field allows it, and a value that is a YAML mapping still builds
    a component spec. Integer parts index lists. A path that is not in the schema is
    an error.
    """
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected PATH=VALUE, e.g. rollout.batch_size=16")
    dotted, text = item.split("=", 1)
    dotted = dotted.strip()
    parts: list[str | int] = [int(p) if p.lstrip("-").isdigit() else p for p in dotted.split(".")]
    if not dotted or any(p == "" for p in parts):
        raise ConfigError(f"--set {item!r}: empty path")

    annotation: Any = root
    container: Any = raw
    for depth, part in enumerate(parts):
        where = ".".join(str(p) for p in parts[: depth + 1])
        try:
            annotation = child_annotation(annotation, part)
        except KeyError:
            siblings = field_names_at(root, tuple(parts[:depth]))
            hint = closest_key(str(part), siblings) if isinstance(part, str) else None
            if hint:
                suggestion = f"did you mean '{join_path(tuple(parts[:depth]), hint)}'?"
            elif siblings:
                suggestion = f"allowed keys: {', '.join(siblings)}"
            else:
                suggestion = "it is not a section or a list"
            raise ConfigError(f"--set {dotted}: '{where}' does not exist; {suggestion}") from None
        last = depth == len(parts) - 1
        if isinstance(part, int):
            if not isinstance(container, list) or not -len(container) <= part < len(container):
                size = len(container) if isinstance(container, list) else 0
                raise ConfigError(f"--set {dotted}: index {part} is out of range ('{where}' has {size} items)")
        elif not isinstance(container, dict):
            raise ConfigError(f"--set {dotted}: '{where}' is inside a value that is not a mapping")
        if last:
            container[part] = _parse_value(text, annotation)
            return
        child = container[part] if (isinstance(part, int) or part in container) else None
        if child is None:
            child = {}
            container[part] = child
        container = child


def _parse_value(text: str, annotation: Any) -> Any:
    _, allows_none = unwrap_optional(annotation)
    stripped = text.strip()
    if _takes_raw_text(annotation):
        if allows_none and stripped in ("null", "~", "None"):
            return None
        if stripped.startswith("{"):
            return _yaml_value(text)
        return text
    return _yaml_value(text)


def _yaml_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text

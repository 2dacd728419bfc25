"""Walking the config schema by dotted path: the annotation at ``a.b.0.c``, the keys allowed
there, and the closest key to a misspelt one. Shared by the ``--set`` parser
(:mod:`asyncrl.config.overrides`), the error formatter (:mod:`asyncrl.config.errors`) and
the docs generator (:mod:`asyncrl.config.docs`); knows no particular section."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Union

from pydantic import BaseModel


def join_path(prefix: tuple, name: str) -> str:
    """``a.b.name`` from the path parts ``(a, b)`` and ``name``."""
    return ".".join([*(str(p) for p in prefix), name])


def closest_key(name: str, options: list[str]) -> str | None:
    """The option most like a misspelt ``name`` (``clip_lo`` -> ``clip_low``), if any is close."""
    found = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return found[0] if found else None


def unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """Strip ``Optional``/``Annotated``; return (inner annotation, allows None)."""
    allows_none = False
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
            continue
        if origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) < len(typing.get_args(annotation)):
                allows_none = True
            if len(args) == 1:
                annotation = args[0]
                continue
            annotation = Union[tuple(args)] if len(args) > 1 else annotation
        return annotation, allows_none


def is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def child_annotation(annotation: Any, key: str | int) -> Any:
    """Annotation of ``annotation[key]``; raises KeyError when there is no such child."""
    annotation, _ = unwrap_optional(annotation)
    if is_model(annotation):
        if key not in annotation.model_fields:
            raise KeyError(key)
        return annotation.model_fields[key].annotation
    origin = typing.get_origin(annotation)
    if origin in (list, tuple) and isinstance(key, int):
        return typing.get_args(annotation)[0]
    if origin is dict:
        return typing.get_args(annotation)[1]
    if annotation is Any:
        return Any
    # Unions of a model with other things (component specs): look inside the model member.
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(annotation):
            try:
                return child_annotation(arg, key)
            except KeyError:
                continue
    raise KeyError(key)


def field_names_at(root: type[BaseModel], loc: tuple) -> list[str]:
    annotation: Any = root
    try:
        for part in loc:
            annotation = child_annotation(annotation, part)
    except KeyError:
        return []
    annotation, _ = unwrap_optional(annotation)
    if is_model(annotation):
        return list(annotation.model_fields)
    for arg in typing.get_args(annotation):
        if is_model(arg):
            return list(arg.model_fields)
    return []

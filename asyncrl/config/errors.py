"""Pydantic validation errors as one line per problem: ``path: what is wrong (given ...)``.

An unknown key names the closest allowed key (``did you mean 'algo.clip_low'?``) or lists
the allowed ones; cross-field checks of the root config name their own dotted paths.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from asyncrl.config.paths import closest_key, field_names_at, join_path


def format_validation_error(err: ValidationError, root: type[BaseModel], source: str | None = None) -> list[str]:
    """One line per problem: ``path: what is wrong (given ...; allowed ...)``."""
    lines = []
    prefix = f"{source}: " if source else ""
    for item in err.errors():
        loc = _clean_loc(item["loc"])
        dotted = ".".join(str(p) for p in loc) or "<root>"
        if item["type"] == "extra_forbidden":
            siblings = field_names_at(root, loc[:-1])
            hint = closest_key(str(loc[-1]), siblings)
            allowed = f"did you mean '{join_path(loc[:-1], hint)}'?" if hint else f"allowed keys: {', '.join(siblings)}"
            lines.append(f"{prefix}{dotted}: unknown key; {allowed}")
            continue
        given = item.get("input")
        msg = item["msg"]
        if item["type"] == "value_error" and not loc:
            # Cross-field validators on the root name their own dotted paths, one per line.
            lines.extend(f"{prefix}{line}" for line in msg.removeprefix("Value error, ").splitlines())
            continue
        if item["type"] == "missing":
            lines.append(f"{prefix}{dotted}: required field is missing")
        elif item["type"] == "value_error" and msg.removeprefix("Value error, ").startswith(f"{dotted}:"):
            # A field validator's own message names the field (and what was given) already.
            message = msg.removeprefix("Value error, ")
            lines.append(f"{prefix}{message}" if "(given" in message else f"{prefix}{message} (given {_short(given)})")
        else:
            lines.append(f"{prefix}{dotted}: {msg} (given {_short(given)})")
    return lines


def _clean_loc(loc: tuple) -> tuple:
    # Union members appear in pydantic's loc as type tags ("str", "ComponentRef",
    # "function-after[...]"); they are not part of the user's path.
    out = []
    for part in loc:
        if isinstance(part, str) and (part in {"str", "int", "float", "bool", "none"} or "[" in part or part[:1].isupper()):
            continue
        out.append(part)
    return tuple(out)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""The config reference (``docs/config.md``), generated from the pydantic models.

``python scripts/gen_config_docs.py`` writes it; ``tests/test_docs.py`` checks it is current.
"""

from __future__ import annotations

import typing
from typing import Any

import yaml
from pydantic import BaseModel

from asyncrl.config import ComponentRef, Config
from asyncrl.config.paths import is_model, unwrap_optional


def config_reference_markdown() -> str:
    """The config reference (``docs/config.md``), generated from the models."""
    lines = [
        "# Config reference",
        "",
        "Generated from the models in `asyncrl/config/tree.py` and `asyncrl/config/sections.py` by `python scripts/gen_config_docs.py`; do not edit by hand.",
        "Every section rejects unknown keys. Override any field on the command line with",
        "`--set section.field=VALUE` (YAML, except that `str` fields take the raw text).",
        "",
    ]
    seen: set[type] = set()

    def section(model: type[BaseModel], dotted: str) -> None:
        lines.append(f"## `{dotted}`" if dotted else "## Top level")
        lines.append("")
        if model.__doc__:
            lines.append(model.__doc__.strip().splitlines()[0])
            lines.append("")
        lines.append("| field | type | default | description |")
        lines.append("|---|---|---|---|")
        nested = []
        for name, field in model.model_fields.items():
            inner, _ = unwrap_optional(field.annotation)
            if is_model(inner) and inner is not ComponentRef:
                nested.append((inner, f"{dotted}.{name}".lstrip(".")))
                default = "see below"
            else:
                default = _default_text(field)
            description = (field.description or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{name}` | {_type_text(field.annotation)} | {default} | {description} |")
            inner_list = typing.get_args(inner) if typing.get_origin(inner) is list else ()
            if inner_list and is_model(inner_list[0]) and inner_list[0] not in seen:
                nested.append((inner_list[0], f"{dotted}.{name}[]".lstrip(".")))
        lines.append("")
        for model_, path in nested:
            seen.add(model_)
            section(model_, path)

    section(Config, "")
    return "\n".join(lines).rstrip() + "\n"


def _default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
    else:
        value = field.default
    return "`" + yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip() + "`"


def _type_text(annotation: Any) -> str:
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = text.replace("typing.", "").replace("asyncrl.config.sections.", "").replace("asyncrl.config.tree.", "").replace("NoneType", "None")
    return text.replace("|", "\\|")

"""Generate the API reference page (``docs/api.md``) from the same models as the CRDs.

Called by ``megafleet crds``; the drift test compares the result with the checked-in page.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

import pydantic
from pydantic.fields import FieldInfo

from megafleet.api import v1alpha1


def _models_in(annotation: Any) -> list[type[pydantic.BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    found: list[type[pydantic.BaseModel]] = []
    for arg in typing.get_args(annotation):
        found.extend(_models_in(arg))
    return found


def _collect(root: type[pydantic.BaseModel], seen: list[type[pydantic.BaseModel]]) -> None:
    if root in seen:
        return
    seen.append(root)
    for field in root.model_fields.values():
        for model in _models_in(field.annotation):
            _collect(model, seen)


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(arg) for arg in args if arg is not type(None))
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return {str: "string", int: "integer", bool: "boolean"}.get(annotation, str(annotation))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return ""
    if isinstance(value, pydantic.BaseModel):
        value = value.model_dump(by_alias=True, exclude_none=True)
    elif isinstance(value, list):
        value = [
            v.model_dump(by_alias=True, exclude_none=True) if isinstance(v, pydantic.BaseModel) else v for v in value
        ]
    if value in ({}, []) or isinstance(value, dict):
        return "`{}`" if value == {} else ("`[]`" if value == [] else "see type")
    return f"`{json.dumps(value)}`"


def _bounds(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        for attribute, label in (("ge", "≥"), ("le", "≤"), ("min_length", "min length"), ("max_length", "max length")):
            value = getattr(item, attribute, None)
            if value is not None:
                parts.append(f"{label} {value}")
    return ", ".join(parts)


def _rules(model: type[pydantic.BaseModel]) -> list[dict[str, str]]:
    extra = model.model_config.get("json_schema_extra")
    if isinstance(extra, dict):
        rules = extra.get("x-kubernetes-validations", [])
        if isinstance(rules, list):
            return [{key: str(value) for key, value in rule.items()} for rule in rules if isinstance(rule, dict)]
    return []


def _section(model: type[pydantic.BaseModel]) -> list[str]:
    lines = [f"### {model.__name__}", "", (model.__doc__ or "").strip(), ""]
    lines += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        json_name = field.alias or name
        description = (field.description or "").replace("|", "\\|")
        lines.append(
            f"| `{json_name}` | {_type_name(field.annotation)} | {_default(field)} | {_bounds(field)} | {description} |"
        )
    rules = _rules(model)
    if rules:
        lines += ["", "Admission rules (CEL):", ""]
        lines += [f"- {rule['message']}" for rule in rules]
    return [*lines, ""]


_SCALE = ", scale (`spec.replicas`, `status.replicas`, `status.selector`)"


def render() -> str:
    """The whole reference page as markdown."""
    lines = [
        "# API reference: `megafleet.dev/v1alpha1`",
        "",
        # The header names the module the models lived in before v1alpha1 became a package
        # (operator/megafleet/api/v1alpha1/): kept so the generated files stayed byte-identical.
        "Generated from `operator/megafleet/api/v1alpha1.py` by `megafleet crds`; do not edit.",
        "",
    ]
    for info in v1alpha1.KINDS:
        lines += [
            f"## {info.kind}",
            "",
            info.description,
            "",
            f"Short names: {', '.join(f'`{name}`' for name in info.short_names)}. "
            f"Subresources: status{_SCALE if info.scale else ''}.",
            "",
        ]
        models: list[type[pydantic.BaseModel]] = []
        _collect(info.spec, models)
        _collect(info.status, models)
        for model in models:
            lines += _section(model)
    return "\n".join(lines).rstrip() + "\n"

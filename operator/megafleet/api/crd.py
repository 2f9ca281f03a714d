"""Generate CustomResourceDefinitions from the pydantic API models.

Called by ``megafleet crds`` (which writes ``crds/`` and ``charts/megafleet/crds/``) and by the
drift test. Converts pydantic's JSON Schema into a Kubernetes *structural* schema: ``$ref``s are
inlined, titles dropped, ``Optional[X]`` becomes ``X`` (absent means unset; null is never sent),
and ``x-kubernetes-*`` extensions declared on the models pass through.
"""

from __future__ import annotations

from typing import Any

import pydantic
import yaml

from megafleet.api import v1alpha1

Schema = dict[str, Any]

# JSON Schema keys a structural schema keeps; everything else pydantic emits is dropped.
_KEPT = {
    "type",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "maxProperties",
    "items",
    "properties",
    "required",
    "additionalProperties",
    "format",
}


def _resolve(schema: Schema, defs: dict[str, Schema]) -> Schema:
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return _resolve(merged, defs)
    any_of = schema.get("anyOf")
    if any_of is not None:
        non_null = [option for option in any_of if option.get("type") != "null"]
        if len(non_null) != 1:
            raise ValueError(f"cannot express anyOf {any_of} in a structural schema")
        merged = {**non_null[0], **{k: v for k, v in schema.items() if k != "anyOf"}}
        if merged.get("default", ...) is None:
            del merged["default"]
        return _resolve(merged, defs)
    return schema


def structural(schema: Schema, defs: dict[str, Schema]) -> Schema:
    """One node of pydantic's JSON Schema as a structural OpenAPI v3 schema."""
    schema = _resolve(schema, defs)
    out: Schema = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-"):
            out[key] = value
        elif key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value, defs)
        elif key == "additionalProperties":
            if value is False:
                continue  # extra="forbid": structural schemas already prune unknown fields
            out[key] = structural(value, defs)
        elif key == "enum":
            out[key] = list(value)
            out.setdefault("type", "string")
        elif key == "const":
            out["enum"] = [value]
        elif key in _KEPT:
            out[key] = value
    if "properties" in out:
        out["type"] = "object"
    return out


def openapi_schema(model: type[pydantic.BaseModel]) -> Schema:
    """The structural schema of ``model`` as used in JSON (camelCase aliases, defaults applied)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def definition(info: v1alpha1.KindInfo) -> dict[str, Any]:
    """The CustomResourceDefinition object of one kind."""
    subresources: dict[str, Any] = {"status": {}}
    if info.scale:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    schema: dict[str, Any] = {
        "type": "object",
        "description": info.description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "apiVersion of the object."},
            "kind": {"type": "string", "description": "kind of the object."},
            "metadata": {"type": "object"},
            "spec": openapi_schema(info.spec),
            "status": openapi_schema(info.status),
        },
    }
    if info.status_default is not None:
        schema["properties"]["status"]["default"] = info.status_default
    if info.validations:
        schema["x-kubernetes-validations"] = list(info.validations)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{info.plural}.{v1alpha1.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "megafleet"},
        },
        "spec": {
            "group": v1alpha1.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": info.kind,
                "listKind": f"{info.kind}List",
                "plural": info.plural,
                "singular": info.singular,
                "shortNames": info.short_names,
                "categories": info.categories,
            },
            "versions": [
                {
                    "name": v1alpha1.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": subresources,
                    "additionalPrinterColumns": info.printer_columns,
                }
            ],
        },
    }


def render(info: v1alpha1.KindInfo) -> str:
    """The CRD as YAML text, stable across runs."""
    # The header names the module the models lived in before v1alpha1 became a package
    # (operator/megafleet/api/v1alpha1/): kept so the generated files stayed byte-identical.
    header = "# Generated from operator/megafleet/api/v1alpha1.py by `megafleet crds`; do not edit.\n"
    return header + yaml.safe_dump(definition(info), sort_keys=False, width=100, allow_unicode=True)


def file_name(info: v1alpha1.KindInfo) -> str:
    return f"{v1alpha1.GROUP}_{info.plural}.yaml"


PEERING_GROUP = "kopf.dev"


def peering_definition() -> dict[str, Any]:
    """The cluster-wide peering kind Kopf uses so that only one operator replica acts at a time:
    every replica keeps a heartbeat in the peering object's status; lower priorities pause."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"clusterkopfpeerings.{PEERING_GROUP}",
            "labels": {"app.kubernetes.io/part-of": "megafleet"},
        },
        "spec": {
            "group": PEERING_GROUP,
            "scope": "Cluster",
            "names": {"kind": "ClusterKopfPeering", "plural": "clusterkopfpeerings", "singular": "clusterkopfpeering"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "Heartbeats of operator replicas: identity -> priority and lastseen.",
                            "properties": {
                                "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                            },
                        }
                    },
                }
            ],
        },
    }


def render_peering() -> str:
    header = "# Generated by `megafleet crds` (Kopf's peering kind, used for operator leader election).\n"
    return header + yaml.safe_dump(peering_definition(), sort_keys=False, width=100)

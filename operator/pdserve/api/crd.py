"""Generate the DisaggregatedModel CustomResourceDefinition from the pydantic models.

The models are the one schema source: the CRD (structural OpenAPI v3 with descriptions, defaults,
enums, bounds and CEL rules) is derived here and written to crds/ and charts/pdserve/crds/. It
is never edited by hand; a test fails when a committed copy is stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pdserve.api.base import CEL, rule
from pdserve.api.resource import MAX_NAME_LENGTH
from pdserve.api.spec import DisaggregatedModelSpec
from pdserve.api.status import DisaggregatedModelStatus
from pdserve.contract.resource import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from pdserve.yamlio import dump

CRD_FILE = f"{GROUP}_{PLURAL}.yaml"
# JSON-schema keywords a structural CRD schema accepts (apiextensions.k8s.io/v1 JSONSchemaProps).
ALLOWED_KEYS = {
    "type", "format", "description", "default", "enum", "maximum", "minimum",
    "exclusiveMaximum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems",
    "minItems", "uniqueItems", "maxProperties", "minProperties", "required", "items",
    "properties", "additionalProperties", "anyOf", "nullable",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string",
    "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-map-type",
}  # fmt: skip

PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Prefill", "type": "string", "jsonPath": ".status.pools.prefill.summary"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.pools.decode.summary"},
    {"name": "Render", "type": "string", "jsonPath": ".status.pools.render.summary"},
    {"name": "Parity", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="ConfigParity")].status'},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "priority": 1},
    {"name": "Placed", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="Placement")].status', "priority": 1},
    {"name": "KV-Verified", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="TransportVerified")].reason', "priority": 1},
    {"name": "KV-Healthy", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="TransportHealthy")].message', "priority": 1},
    {"name": "Contract", "type": "string",
     "jsonPath": '.status.conditions[?(@.type=="ContractVerified")].reason', "priority": 1},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]  # fmt: skip


def _description(text: str | None) -> str | None:
    return " ".join(text.split()) if text else None


class _Converter:
    """pydantic JSON schema (draft 2020-12 with $defs) -> structural OpenAPI v3 schema."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.defs: dict[str, Any] = schema.get("$defs", {})
        self.root = schema

    def convert(self, node: dict[str, Any]) -> dict[str, Any]:
        node = dict(node)
        if "$ref" in node:
            target = self.defs[node.pop("$ref").rsplit("/", 1)[-1]]
            node = {**target, **node}  # the field's own description/default win
        if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
            options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
            if len(options) != 1:
                raise ValueError(f"cannot express a union in a structural schema: {options}")
            inner = options[0]
            node = {**self._resolve(inner), **node}
            if "$ref" in node:
                return self.convert(node)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "properties":
                out[key] = {name: self.convert(sub) for name, sub in value.items()}
            elif key == "items":
                out[key] = self.convert(value)
            elif key == "additionalProperties":
                if isinstance(value, dict) and not node.get("x-kubernetes-preserve-unknown-fields"):
                    out[key] = self.convert(value)
            elif key == "anyOf":  # only int-or-string gets here; the API server wants this form
                out[key] = [{"type": "integer"}, {"type": "string"}]
            elif key == "description":
                out[key] = _description(value)
            elif key == "exclusiveMinimum" and not isinstance(value, bool):
                out["minimum"], out["exclusiveMinimum"] = value, True
            elif key == "exclusiveMaximum" and not isinstance(value, bool):
                out["maximum"], out["exclusiveMaximum"] = value, True
            elif key == "default" and value is None:
                continue
            elif key in ALLOWED_KEYS:
                out[key] = value
        if out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("type", "object")
        if out.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
        return out

    def _resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in node:
            return {**self.defs[node["$ref"].rsplit("/", 1)[-1]], **{
                k: v for k, v in node.items() if k != "$ref"
            }}  # fmt: skip
        return node


def _add_factory_defaults(model: type[BaseModel], schema: dict[str, Any]) -> None:
    """JSON schema omits defaults made by default_factory; the CRD needs them so the API server
    fills nested defaults in (kubectl get -o yaml then shows what will run)."""
    properties = schema.get("properties", {})
    for name, field in model.model_fields.items():
        alias = field.alias or name
        if alias not in properties:
            continue
        sub_model = _model_of(field)
        if field.default_factory is not None:
            value = field.default_factory()  # type: ignore[call-arg]
            if isinstance(value, BaseModel):
                # {} lets the API server cascade the nested defaults; only non-default values
                # (e.g. render's CPU request) are spelled out.
                properties[alias]["default"] = value.model_dump(
                    by_alias=True, exclude_defaults=True, mode="json"
                )
            elif value:  # empty lists and maps stay unset rather than filled with [] and {}
                properties[alias]["default"] = value
        if sub_model is not None:
            _add_factory_defaults(sub_model, properties[alias])


def _model_of(field: FieldInfo) -> type[BaseModel] | None:
    annotation = field.annotation
    candidates = getattr(annotation, "__args__", (annotation,))
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    converter = _Converter(raw)
    schema = converter.convert({k: v for k, v in raw.items() if k != "$defs"})
    _add_factory_defaults(model, schema)
    return schema


def build_crd() -> dict[str, Any]:
    spec_schema = structural_schema(DisaggregatedModelSpec)
    status_schema = structural_schema(DisaggregatedModelStatus)
    root = {
        "type": "object",
        "description": "DisaggregatedModel serves one model with vLLM as disaggregated prefill "
        "and decode GPU pools, a CPU render pool and an OpenAI-compatible gateway.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
        CEL: [
            rule(
                f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
                f"metadata.name must be at most {MAX_NAME_LENGTH} characters: it prefixes the "
                "child names (<name>-prefill, <name>-gateway, ...)",
            )
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["pdserve"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render_crd() -> str:
    header = "# Generated by `pdserve crd` from operator/pdserve/api. Do not edit.\n"
    return header + dump(build_crd())


def crd_paths(repo_root: Path) -> list[Path]:
    return [repo_root / "crds" / CRD_FILE, repo_root / "charts" / "pdserve" / "crds" / CRD_FILE]


def write_crds(repo_root: Path) -> list[Path]:
    text = render_crd()
    paths = crd_paths(repo_root)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return paths

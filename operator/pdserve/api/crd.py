"""Generate the DisaggregatedModel CustomResourceDefinition from the pydantic models.

The models are the one schema source: the CRD (structural OpenAPI v3 with descriptions, defaults,
enums, bounds and CEL rules) is derived here and written, by `pdserve crd --write .`, to crds/
(plain, for kubectl and other tools) and to the chart's templates/crds.yaml (the same CRD under
`crds.install`, kept by `helm uninstall`: Helm installs a chart's crds/ once and never upgrades
it, so the chart carries none). Never edited by hand; a test fails when a written file is stale.
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
    "x-kubernetes-list-map-keys",
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


# The chart's CRD template: `crds.install` (pdserve.installCRDs in _helpers.tpl: true also where
# an upgrade with --reuse-values brings values from a chart that had no such key), the chart's
# labels, and helm.sh/resource-policy: keep, which `helm uninstall` and an upgrade that drops the
# CRD (crds.install=false) obey: deleting the CRD would delete every DisaggregatedModel.
CHART_CRD_HEAD = """\
{{- /* Generated by `pdserve crd --write .` from operator/pdserve/api. Do not edit. */}}
{{- if include "pdserve.installCRDs" . }}
"""
CHART_CRD_METADATA = """\
metadata:
  name: %(name)s
  labels:
%(labels)s    app.kubernetes.io/instance: {{ .Release.Name }}
    app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
    app.kubernetes.io/managed-by: {{ .Release.Service }}
    helm.sh/chart: {{ printf "%%s-%%s" .Chart.Name .Chart.Version }}
  annotations:
    helm.sh/resource-policy: keep
"""


def _template_literal(text: str) -> str:
    """YAML text as a Go template that renders to itself: every `{{` (a chat template in a
    description, say) becomes an action printing it."""
    return text.replace("{{", '{{ "{{" }}')


def render_chart_crd(crd: dict[str, Any] | None = None) -> str:
    """charts/pdserve/templates/crds.yaml for `crd` (default: this version's CRD)."""
    crd = build_crd() if crd is None else crd
    metadata = crd["metadata"]
    labels = "".join(f"    {key}: {value}\n" for key, value in metadata["labels"].items())
    head = {key: value for key, value in crd.items() if key in ("apiVersion", "kind")}
    return (
        CHART_CRD_HEAD
        + _template_literal(dump(head))
        + CHART_CRD_METADATA % {"name": metadata["name"], "labels": labels}
        + _template_literal(dump({"spec": crd["spec"]}))
        + "{{- end }}\n"
    )


def generated_files(repo_root: Path) -> dict[Path, str]:
    """What `pdserve crd --write REPO_ROOT` writes, by path: one CRD, two forms."""
    return {
        repo_root / "crds" / CRD_FILE: render_crd(),
        repo_root / "charts" / "pdserve" / "templates" / "crds.yaml": render_chart_crd(),
    }


def write_crds(repo_root: Path) -> list[Path]:
    written = []
    for path, text in generated_files(repo_root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written

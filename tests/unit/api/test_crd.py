"""The CRD is generated from the API models; committed copies must match the generator."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api.crd import build_crd, generated_files, render_chart_crd, render_crd

REPO = Path(__file__).resolve().parents[3]


def schema() -> dict[str, Any]:
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    result: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return result


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from walk(value, f"{path}[{index}]")


@pytest.mark.parametrize("path", generated_files(REPO), ids=lambda p: str(p.relative_to(REPO)))
def test_committed_crd_files_are_current(path: Path) -> None:
    """crds/ (kubectl) and the chart's template: one CRD from one generator."""
    assert path.exists(), f"{path} is missing: run `pdserve crd --write .`"
    expected = generated_files(REPO)[path]
    assert path.read_text() == expected, f"{path} is stale: run `pdserve crd --write .`"


def test_the_chart_carries_its_crd_as_a_template_only() -> None:
    """Helm installs a chart's crds/ once and never upgrades it, and beside the template the same
    object would be created twice on a fresh install (crds/ first, then the template refused:
    invalid ownership metadata)."""
    assert not (REPO / "charts" / "pdserve" / "crds").exists()
    assert (REPO / "charts" / "pdserve" / "templates" / "crds.yaml") in generated_files(REPO)


def test_chart_template_is_the_crd_with_the_charts_metadata() -> None:
    """Without its template lines the chart's copy is the CRD itself, plus the chart's labels and
    the keep policy."""
    lines = render_chart_crd().splitlines(keepends=True)
    assert lines[1] == '{{- if include "pdserve.installCRDs" . }}\n'
    assert lines[-1] == "{{- end }}\n"
    body = yaml.safe_load("".join(line for line in lines if "{{" not in line))
    crd = build_crd()
    assert body["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert body["metadata"]["labels"].items() >= crd["metadata"]["labels"].items()
    assert {**body, "metadata": crd["metadata"]} == crd


def test_chart_template_prints_braces_in_descriptions_literally() -> None:
    """A `{{` in the CRD's text (a chat template in a description) would be a template action:
    it is written as one that prints it."""
    crd = build_crd()
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"] = "a {{ x }} b"
    text = render_chart_crd(crd)
    assert 'description: a {{ "{{" }} x }} b' in text
    assert text.count("{{") == render_chart_crd().count("{{") + 2


def test_schema_uses_only_structural_keywords() -> None:
    for path, node in walk(schema()):
        assert not {"$ref", "$defs", "title", "const", "allOf", "oneOf"} & set(node), path


def test_every_spec_field_is_documented_for_kubectl_explain() -> None:
    def fields(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
        for name, sub in node.get("properties", {}).items():
            yield f"{path}.{name}", sub
            yield from fields(sub, f"{path}.{name}")
            if "items" in sub:
                yield from fields(sub["items"], f"{path}.{name}[]")

    undocumented = [p for p, sub in fields(schema()["properties"]["spec"], "spec")
                    if not sub.get("description")]  # fmt: skip
    assert undocumented == []


def test_cross_field_rules_are_cel_validations() -> None:
    rules = {
        rule["message"]
        for _, node in walk(schema())
        for rule in node.get("x-kubernetes-validations", [])
    }
    assert "maxReplicas must be >= minReplicas" in rules
    assert "loadFailurePolicy needs a NIXL connector (NixlConnector, NixlPushConnector)" in rules
    assert "enableAutoToolChoice needs toolCallParser" in rules
    assert any(r.startswith("metadata.name must be at most 40 characters") for r in rules)


def test_names_columns_and_status_subresource() -> None:
    crd = build_crd()
    assert crd["metadata"]["name"] == "disaggregatedmodels.pdserve.io"
    assert crd["spec"]["names"]["shortNames"] == ["dm", "dmodel"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if "priority" not in c]
    assert columns == ["Ready", "Prefill", "Decode", "Render", "Parity", "Age"]


def test_defaults_and_enums_come_from_the_models() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    decode = spec["decode"]["properties"]
    assert decode["replicas"]["default"] == 1
    assert decode["gpuMemoryUtilization"] == {
        **decode["gpuMemoryUtilization"], "minimum": 0, "exclusiveMinimum": True, "maximum": 1,
    }  # fmt: skip
    assert spec["kvTransfer"]["properties"]["connector"]["enum"] == [
        "NixlConnector", "NixlPushConnector", "LMCacheConnectorV1", "MooncakeConnector",
    ]  # fmt: skip
    # No CPU default: it follows render.workers (a core per worker).
    assert spec["render"]["properties"]["resources"]["default"]["requests"] == {"memory": "2Gi"}
    scaling = spec["render"]["properties"]["autoscaling"]["properties"]
    assert scaling["engine"]["enum"] == ["HPA", "KEDA", "Builtin"]
    assert scaling["engine"]["default"] == "HPA"


def test_render_is_stable_yaml_without_anchors() -> None:
    text = render_crd()
    assert text == render_crd()
    assert "&id" not in text
    assert yaml.safe_load(text) == build_crd()

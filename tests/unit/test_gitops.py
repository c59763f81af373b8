"""GitOps examples: the Argo CD health check (run in a real Lua interpreter) and the Argo CD /
Flux objects pointing at paths that exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa
import pytest
import yaml

GITOPS = Path(__file__).resolve().parents[2] / "examples" / "gitops"
HEALTH = (GITOPS / "argocd" / "health-disaggregatedmodel.lua").read_text()


def health(obj: dict[str, Any]) -> tuple[str, str]:
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    to_lua = lua.eval("""
      function(convert, value) return convert(value) end
    """)

    def convert(value: Any) -> Any:
        if isinstance(value, dict):
            return lua.table_from({k: convert(v) for k, v in value.items()})
        if isinstance(value, list):
            return lua.table_from([convert(v) for v in value])
        return value

    lua.globals().obj = to_lua(convert, obj)
    result = lua.execute(HEALTH)
    return str(result["status"]), str(result["message"])


def model(generation: int, status: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "m", "generation": generation}}
    if status is not None:
        body["status"] = status
    return body


def cond(kind: str, status: str, message: str = "") -> dict[str, str]:
    return {"type": kind, "status": status, "message": message}


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        (model(1, None), "Progressing"),
        (model(2, {"observedGeneration": 1, "conditions": [cond("Ready", "True")]}), "Progressing"),
        (model(2, {"observedGeneration": 2, "phase": "Ready",
                   "conditions": [cond("Ready", "True", "every pool is ready"),
                                  cond("Degraded", "False")]}), "Healthy"),
        (model(2, {"observedGeneration": 2, "phase": "Progressing",
                   "conditions": [cond("Ready", "False", "waiting for decode 0/1 ready")]}), "Progressing"),
        (model(3, {"observedGeneration": 3, "phase": "Degraded",
                   "conditions": [cond("Ready", "False"),
                                  cond("Degraded", "True", "decode pod m-decode-0: Unschedulable")]}),
         "Degraded"),
        (model(1, {"observedGeneration": 1, "phase": "Failed",
                   "conditions": [cond("Ready", "False", "spec.decode.replicas: bad")]}), "Degraded"),
    ],
)  # fmt: skip
def test_argocd_health_follows_conditions_and_generation(
    obj: dict[str, Any], expected: str
) -> None:
    status, message = health(obj)
    assert status == expected
    assert message


def test_argocd_and_flux_objects_point_at_real_paths() -> None:
    repo = GITOPS.parents[1]
    application = yaml.safe_load((GITOPS / "argocd" / "application.yaml").read_text())
    assert (repo / application["spec"]["source"]["path"] / "kustomization.yaml").exists()
    assert "ServerSideApply=true" in application["spec"]["syncPolicy"]["syncOptions"]
    flux = yaml.safe_load((GITOPS / "flux" / "kustomization.yaml").read_text())
    assert (repo / flux["spec"]["path"] / "kustomization.yaml").exists()
    release = yaml.safe_load((GITOPS / "flux" / "helmrelease.yaml").read_text())
    chart = repo / release["spec"]["chart"]["spec"]["chart"]
    assert (chart / "Chart.yaml").exists()
    # The chart upgrades its CRD as a template; Flux's CRD policies (for crds/) are not needed.
    assert (chart / "templates" / "crds.yaml").exists()
    assert not (chart / "crds").exists()
    assert "upgrade" not in release["spec"]


def test_argocd_config_patch_carries_the_same_health_script() -> None:
    patch = yaml.safe_load((GITOPS / "argocd" / "argocd-cm-patch.yaml").read_text())
    key = "resource.customizations.health.pdserve.io_DisaggregatedModel"
    assert patch["data"][key].strip() == HEALTH.strip()

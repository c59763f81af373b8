"""The validating admission webhook (kopf) on the real API server: specs the CRD schema cannot
judge (parity flags in extraArgs, ...) are refused at apply time, naming the field."""

from __future__ import annotations

import httpx
import pytest
import yaml

from devtools.clitools import Kubectl
from devtools.resources import apply_dm, dm_url, get

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("dm_crd")]

SPEC = {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "prefill": {}}


@pytest.mark.usefixtures("operator_with_webhook")
def test_parity_violation_is_refused_at_apply_time_naming_the_field(
    http_api: httpx.Client, namespace: str
) -> None:
    spec = {**SPEC, "decode": {"extraArgs": ["--tool-call-parser", "hermes"]}}
    body = {"apiVersion": "pdserve.io/v1alpha1", "kind": "DisaggregatedModel",
            "metadata": {"name": "bad"}, "spec": spec}  # fmt: skip
    response = http_api.post(dm_url(namespace), json=body)
    assert response.status_code == 422, response.text
    message = response.json()["message"]
    assert 'admission webhook "spec.validate.pdserve.io" denied the request' in message
    assert "spec.decode.extraArgs[0] sets parity flag --tool-call-parser" in message
    assert "set it once in spec.serving.toolCallParser" in message
    assert get(http_api, dm_url(namespace, "bad")) is None


@pytest.mark.usefixtures("operator_with_webhook")
def test_valid_specs_pass_and_updates_are_checked_too(
    http_api: httpx.Client, namespace: str, kubectl: Kubectl
) -> None:
    apply_dm(http_api, namespace, "good", SPEC)
    spec = {**SPEC, "prefill": {"env": [{"name": "PYTHONHASHSEED", "value": "1"}]}}
    broken = {"apiVersion": "pdserve.io/v1alpha1", "kind": "DisaggregatedModel",
              "metadata": {"name": "good", "namespace": namespace}, "spec": spec}  # fmt: skip
    applied = kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(broken))
    assert applied.returncode != 0
    assert "spec.prefill.env[0] sets parity variable PYTHONHASHSEED" in applied.stderr

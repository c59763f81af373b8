"""A CRD newer than the operator (mid upgrade, or after a rollback of the operator alone): the
API server defaults and stores fields this operator does not know. Objects it stores are parsed
with those fields left out and named, so applies keep being admitted and models keep being
reconciled; files parsed offline still refuse them (a typo there has no CRD to catch it)."""

from __future__ import annotations

from typing import Any, cast

import kopf
import pytest

from pdserve.api import SpecError, parse_resource, parse_stored
from pdserve.controller import handlers
from pdserve.controller.settings import OperatorSettings, WebhookSettings
from pdserve.kube.client import Kube
from pdserve.kube.credentials import Credentials
from tests.support.fakekube import FakeKube
from tests.unit.api.test_api import resource

NEWER = resource(
    decode={"replicas": 2, "futureDrain": 5, "env": [{"name": "A", "value": "1", "future": 1}]},
    futureTopLevel={"x": 1},
)


def test_stored_fields_of_a_newer_crd_are_left_out_and_named() -> None:
    dm, warnings = parse_stored(NEWER)
    assert dm.spec.decode.replicas == 2
    assert sorted(w.split(":")[0] for w in warnings) == [
        "spec.decode.env[0].future", "spec.decode.futureDrain", "spec.futureTopLevel",
    ]  # fmt: skip
    assert all("the CRD is newer than the operator" in w for w in warnings)
    assert parse_stored(resource())[1] == []


def test_offline_files_still_refuse_unknown_fields() -> None:
    with pytest.raises(SpecError) as caught:
        parse_resource(NEWER)
    assert any(
        p.startswith("spec.decode.futureDrain: unknown field") for p in caught.value.problems
    )


def test_a_real_problem_beside_a_newer_field_is_still_refused_naming_it() -> None:
    with pytest.raises(SpecError) as caught:
        parse_stored(resource(decode={"replicas": -1, "futureDrain": 5}))
    assert caught.value.problems == [
        "spec.decode.replicas: Input should be greater than or equal to 0"
    ]


def webhook(namespace_labels: dict[str, str] | None = None) -> Any:
    """The validate handler as kopf serves it before the startup handler ran, its API calls
    answered by an in-memory API server holding namespace `llm` with `namespace_labels`."""
    settings = OperatorSettings(engine_metrics_seconds=0, autoscale_seconds=0,
                                webhook=WebhookSettings(9443, "tls.crt", "tls.key"))  # fmt: skip
    registry, running = handlers.build_registry(
        Credentials(server="https://api.test", token="t"), settings
    )
    kube = FakeKube()
    kube.put({"apiVersion": "v1", "kind": "Namespace",
              "metadata": {"name": "llm", "labels": namespace_labels or {}}})  # fmt: skip
    running.webhook_kube = cast(Kube, kube)
    [found] = [h.fn for h in registry._webhooks.get_all_handlers()
               if getattr(h.fn, "__name__", "") == "validate"]  # fmt: skip
    return found


async def test_the_webhook_admits_newer_fields_with_a_warning_and_refuses_real_problems() -> None:
    validate = webhook()
    warnings: list[str] = []
    await validate(body=NEWER, warnings=warnings)
    assert len(warnings) == 3
    assert any(w.startswith("spec.decode.futureDrain: not known") for w in warnings)
    with pytest.raises(kopf.AdmissionError) as refused:
        await validate(body=resource(decode={"extraArgs": ["--block-size", "32"]}), warnings=[])
    assert "spec.decode.extraArgs" in str(refused.value)


async def test_the_webhook_judges_pod_security_before_the_operator_finished_starting() -> None:
    validate = webhook({"pod-security.kubernetes.io/enforce": "restricted"})
    with pytest.raises(kopf.AdmissionError) as refused:
        await validate(body=resource(), warnings=[])
    assert "namespace llm enforces Pod Security 'restricted'" in str(refused.value)

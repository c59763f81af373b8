"""A model behind an API key, as a user sets one (a Secret, `spec.gateway.apiKeySecretRef`), on
the real node: the deployed gateway refuses the OpenAI SDK without the key and answers with it,
its /metrics stays scrapeable without one, the replicas' peer key (derived from the operator's
master key) opens /status, not /v1, and taking the key away opens the model again. The example's
gateway runs two replicas, so they have the peer key before, during and after, the same one:
without it their holds on each other would be refused, and anyone could hold every slot."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import httpx
import openai
import pytest

from devtools.localplane import wait_until
from pdserve.contract.names import PEER_MASTER_SECRET_KEY, PEER_MASTER_SECRET_NAME
from tests.support.realcluster import (
    MODEL_NAMESPACE,
    RELEASE_NAMESPACE,
    Cluster,
    patch_dm,
    pods,
    settled,
)

GATEWAY = "app.kubernetes.io/component=gateway"
SECRET, KEY = "sim-qwen3-api-key", "e2e-secret-key"
PEER_SECRET = "sim-qwen3-gateway-peer-key"
QUESTION = [{"role": "user", "content": "are you there?"}]


def gateways_have_key(cluster: Cluster, keyed: bool) -> bool:
    """Every gateway pod with the API key or without it (`keyed`), and with the peer key."""

    def keys_of(pod: dict[str, object]) -> tuple[bool, bool]:
        container = pod["spec"]["containers"][0]  # type: ignore[index]
        api_key = any(e["name"] == "PDSERVE_API_KEY" for e in container.get("env", []))
        return api_key, "--peer-key-file" in container["args"]

    gateways = pods(cluster, MODEL_NAMESPACE, GATEWAY)
    return (
        settled(cluster) and bool(gateways) and all(keys_of(p) == (keyed, True) for p in gateways)
    )


def holds_refused_without_the_peer_key(base: str) -> bool:
    """A hold without a key or with a wrong one: 401, API keys or not."""
    wrong = {"Authorization": "Bearer not-the-peer-key"}
    return all(
        httpx.post(f"{base}/admission/hold", headers=headers, timeout=10).status_code == 401
        for headers in ({}, wrong)
    )


def peer_key(cluster: Cluster) -> str | None:
    """The key the operator derived, as an admin reads it; None once the Secret is gone."""
    got = cluster.kubectl(
        "get", "secret", PEER_SECRET, "-n", MODEL_NAMESPACE, "-o", "json", check=False
    )
    if got.returncode != 0:
        return None
    return base64.b64decode(json.loads(got.stdout)["data"]["peer-key"]).decode()


def derived_key(cluster: Cluster) -> str:
    """HMAC-SHA256(master, "<namespace>/<name>/<uid>"), from the operator's master Secret."""
    master = json.loads(cluster.kubectl(
        "get", "secret", PEER_MASTER_SECRET_NAME, "-n", RELEASE_NAMESPACE, "-o", "json"
    ).stdout)["data"][PEER_MASTER_SECRET_KEY]  # fmt: skip
    uid = cluster.kubectl(
        "get", "dm", "sim-qwen3", "-n", MODEL_NAMESPACE, "-o", "jsonpath={.metadata.uid}"
    ).stdout.strip()
    message = f"{MODEL_NAMESPACE}/sim-qwen3/{uid}".encode()
    return hmac.new(base64.b64decode(master), message, hashlib.sha256).hexdigest()


def ask(model: str, api_key: str) -> str | None:
    """The answer's finish_reason (its first tokens may all be the model's reasoning)."""
    client = openai.OpenAI(base_url=model, api_key=api_key, timeout=30, max_retries=0)
    chat = client.chat.completions.create(model="sim-qwen3", messages=QUESTION, max_tokens=8)  # type: ignore[arg-type]
    return chat.choices[0].finish_reason


def test_a_model_behind_an_api_key_answers_only_with_it(cluster: Cluster, model: str) -> None:
    base = model.removesuffix("/v1")
    # Without API keys, two replicas: the peer key already, for their holds alone.
    wait_until("the gateways to have the peer key", lambda: gateways_have_key(cluster, False),
               timeout=180, interval=1)  # fmt: skip
    keyless = peer_key(cluster)
    assert keyless
    assert keyless == derived_key(cluster)
    assert httpx.get(f"{base}/status", timeout=10).status_code == 200  # open without API keys
    assert holds_refused_without_the_peer_key(base)
    cluster.kubectl("create", "secret", "generic", SECRET, "-n", MODEL_NAMESPACE,
                    f"--from-literal=key={KEY}")  # fmt: skip
    try:
        patch_dm(
            cluster, {"spec": {"gateway": {"apiKeySecretRef": {"name": SECRET, "key": "key"}}}}
        )
        wait_until("the gateways to roll with the key", lambda: gateways_have_key(cluster, True),
                   timeout=180, interval=1)  # fmt: skip
        with pytest.raises(openai.AuthenticationError):
            ask(model, "not-the-key")
        assert ask(model, KEY) in ("stop", "length")
        # Prometheus and the operator scrape the gateway without the key.
        metrics = httpx.get(f"{base}/metrics", timeout=10)
        assert metrics.status_code == 200
        # (through the Service, any replica answers: not necessarily the one that served)
        assert "# TYPE pdserve_gateway_requests_total counter" in metrics.text
        # The replicas' own key, never the client's: it opens /status, not the OpenAI API.
        peer = peer_key(cluster)
        assert peer
        assert peer != KEY
        assert peer == keyless  # derived from the model's identity alone: no new key
        bearer = {"Authorization": f"Bearer {peer}"}
        assert httpx.get(f"{base}/status", timeout=10).status_code == 401
        assert httpx.get(f"{base}/status", headers=bearer, timeout=10).status_code == 200
        assert httpx.get(f"{model}/models", headers=bearer, timeout=10).status_code == 401
        assert holds_refused_without_the_peer_key(base)
    finally:
        patch_dm(cluster, {"spec": {"gateway": {"apiKeySecretRef": None}}})
        wait_until("the gateways to roll without the key",
                   lambda: gateways_have_key(cluster, False), timeout=180, interval=1)  # fmt: skip
        cluster.kubectl("delete", "secret", SECRET, "-n", MODEL_NAMESPACE, check=False)
    assert ask(model, "anything") in ("stop", "length")  # open again, as before the key
    # The replicas keep their key (two of them still hold on each other): not pruned.
    assert peer_key(cluster) == keyless
    assert holds_refused_without_the_peer_key(base)

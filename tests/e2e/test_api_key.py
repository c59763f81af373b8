"""A model behind an API key, as a user sets one (a Secret, `spec.gateway.apiKeySecretRef`), on
the real node: the deployed gateway refuses the OpenAI SDK without the key and answers with it,
its /metrics stays scrapeable without one, and taking the key away opens the model again."""

from __future__ import annotations

import httpx
import openai
import pytest

from devtools.localplane import wait_until
from tests.support.realcluster import MODEL_NAMESPACE, Cluster, patch_dm, pods, settled

GATEWAY = "app.kubernetes.io/component=gateway"
SECRET, KEY = "sim-qwen3-api-key", "e2e-secret-key"
QUESTION = [{"role": "user", "content": "are you there?"}]


def gateways_have_key(cluster: Cluster, keyed: bool) -> bool:
    def keyed_pod(pod: dict[str, object]) -> bool:
        env = pod["spec"]["containers"][0].get("env", [])  # type: ignore[index]
        return any(e["name"] == "PDSERVE_API_KEY" for e in env)

    gateways = pods(cluster, MODEL_NAMESPACE, GATEWAY)
    return settled(cluster) and bool(gateways) and all(keyed_pod(p) == keyed for p in gateways)


def ask(model: str, api_key: str) -> str | None:
    """The answer's finish_reason (its first tokens may all be the model's reasoning)."""
    client = openai.OpenAI(base_url=model, api_key=api_key, timeout=30, max_retries=0)
    chat = client.chat.completions.create(model="sim-qwen3", messages=QUESTION, max_tokens=8)  # type: ignore[arg-type]
    return chat.choices[0].finish_reason


def test_a_model_behind_an_api_key_answers_only_with_it(cluster: Cluster, model: str) -> None:
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
        metrics = httpx.get(model.removesuffix("/v1") + "/metrics", timeout=10)
        assert metrics.status_code == 200
        # (through the Service, any replica answers: not necessarily the one that served)
        assert "# TYPE pdserve_gateway_requests_total counter" in metrics.text
    finally:
        patch_dm(cluster, {"spec": {"gateway": {"apiKeySecretRef": None}}})
        wait_until("the gateways to roll without the key",
                   lambda: gateways_have_key(cluster, False), timeout=180, interval=1)  # fmt: skip
        cluster.kubectl("delete", "secret", SECRET, "-n", MODEL_NAMESPACE, check=False)
    assert ask(model, "anything") in ("stop", "length")  # open again, as before the key

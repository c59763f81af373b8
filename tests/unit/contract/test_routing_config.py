"""The routing ConfigMap round-trips: what the operator writes is what the gateway reads, field
for field, and a key the gateway does not know stops it with the key named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.builders import build_all, parity_hash, routing_config
from pdserve.contract.routing import (
    ROUTING_KEY,
    ConfigError,
    GatewayConfig,
    config_text_of,
    load_config,
)
from pdserve.manifests import load_resources

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def configmap_text(path: Path) -> tuple[str, GatewayConfig]:
    [dm] = load_resources(path)
    [configmap] = [
        o for o in build_all(dm) if o["kind"] == "ConfigMap" and ROUTING_KEY in o.get("data", {})
    ]
    return configmap["data"][ROUTING_KEY], routing_config(dm, parity_hash(dm))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_gateway_reads_back_every_field_the_operator_writes(path: Path, tmp_path: Path) -> None:
    text, written = configmap_text(path)
    file = tmp_path / ROUTING_KEY
    file.write_text(text)
    read = load_config(file)
    assert read == written
    assert config_text_of(read) == text
    # Every field is the operator's to set, except the static endpoints of runs outside a
    # cluster (and what the engines behind a render pool run, when there is none).
    unset = {"endpoints"} | ({"tokens_engines"} if written.engine_api == "openai" else set())
    assert written.model_fields_set == set(GatewayConfig.model_fields) - unset


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda c: c.update(parityHashes=c.pop("parityHash")), "parityHashes"),
        (lambda c: c["routing"].update(modes="Auto"), "routing.modes"),
        (lambda c: c["kvTransfer"].update(verify="Sometimes"), "kvTransfer.verify"),
    ],
    ids=["renamed key", "unknown nested key", "bad value"],
)
def test_a_config_the_gateway_cannot_read_fully_stops_it_naming_the_key(
    change: object, named: str, tmp_path: Path
) -> None:
    text, _ = configmap_text(REPO / "examples" / "sim-qwen3.yaml")
    body = json.loads(text)
    change(body)  # type: ignore[operator]
    file = tmp_path / ROUTING_KEY
    file.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")) as error:
        load_config(file)
    assert str(file) in str(error.value)
    if named != "kvTransfer.verify":
        assert "unknown key" in str(error.value)


@pytest.mark.parametrize(
    ("engine_api", "tokens_engines", "refuses"),
    [("tokens", "tokens_only", True), ("tokens", "scale_out", False),
     ("openai", "tokens_only", False), ("tokens", None, False)],
)  # fmt: skip
def test_only_tokens_only_engines_behind_render_make_the_gateway_refuse(
    engine_api: str, tokens_engines: str | None, refuses: bool
) -> None:
    body: dict[str, object] = {"model": "m", "engineApi": engine_api,
                               "pools": {"decode": {"service": "d", "port": 8000}}}  # fmt: skip
    if tokens_engines is not None:
        body["tokensEngines"] = tokens_engines
    assert GatewayConfig.model_validate(body).tokens_only_engines is refuses

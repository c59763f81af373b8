"""The routing ConfigMap round-trips: what the operator writes is what the gateway reads, field
for field, and a key the gateway does not know stops it with the key named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.builders import build_all, parity_hash, routing_config
from pdserve.contract.routing import (
    ROUTING_KEY,
    SCHEMA_VERSION,
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
    # cluster (and what the engines behind a render pool run, when there is none; adapters,
    # when the model has none).
    unset = {"endpoints"} | ({"tokens_engines"} if written.engine_api == "openai" else set())
    unset |= set() if written.adapters else {"adapters"}
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


# ---- skew between the operator and the gateways (SCHEMA_VERSION's rule) --------------------

SCHEMAS = sorted((Path(__file__).parent / "routing_schemas").glob("*.json"), key=lambda p: p.stem)
"""A file each earlier schema version's operator wrote (for examples/sim-qwen3.yaml): each new
SCHEMA_VERSION adds its own, and a gateway must keep reading all of them."""


def test_the_operator_writes_this_schema_version_and_its_file_is_kept(tmp_path: Path) -> None:
    """With every key set (adapters), the file is this version's; without the keys version 4
    added, it is the version-3 file it was, so an upgrade rewrites no model's gateway."""
    text, written = configmap_text(with_adapters(tmp_path))
    assert written.schema_version == SCHEMA_VERSION
    assert [int(p.stem) for p in SCHEMAS] == list(range(1, SCHEMA_VERSION + 1)), (
        f"add routing_schemas/{SCHEMA_VERSION}.json: the file this operator writes"
    )
    assert json.loads(SCHEMAS[-1].read_text()) == json.loads(text)
    text, written = configmap_text(REPO / "examples" / "sim-qwen3.yaml")
    assert written.schema_version == 3
    assert json.loads((SCHEMAS[0].parent / "3.json").read_text()) == json.loads(text)


def with_adapters(tmp_path: Path) -> Path:
    """examples/sim-qwen3.yaml with a LoRA adapter."""
    text = (REPO / "examples" / "sim-qwen3.yaml").read_text()
    adapter = "    adapters:\n      - {name: sql, pvc: {claimName: adapters, path: sql}}\n"
    text = text.replace("    name: Qwen/Qwen3-8B\n", "    name: Qwen/Qwen3-8B\n" + adapter, 1)
    path = tmp_path / "sim-qwen3-adapters.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", SCHEMAS, ids=lambda p: f"schema-{p.stem}")
def test_a_gateway_reads_the_files_of_older_operators(path: Path) -> None:
    config = load_config(path)
    assert config.model == "sim-qwen3"
    assert config.schema_version == int(path.stem)


def test_a_gateway_reads_a_newer_operators_file_leaving_out_what_it_does_not_know(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text, written = configmap_text(with_adapters(tmp_path))
    body = json.loads(text)
    body["schemaVersion"] = SCHEMA_VERSION + 1
    body["routing"]["prefixAwareness"] = "Strict"  # keys a newer pdserve added
    body["tenants"] = [{"name": "a"}]
    file = tmp_path / ROUTING_KEY
    file.write_text(json.dumps(body))
    with caplog.at_level("WARNING", logger="pdserve.gateway"):
        config = load_config(file)
    assert config.model_copy(update={"schema_version": SCHEMA_VERSION}) == written
    [warning] = caplog.messages
    assert f"newer than this gateway's {SCHEMA_VERSION}" in warning
    assert "routing.prefixAwareness" in warning
    assert "tenants" in warning
    # The same keys in a file of this gateway's own version: a typo, refused.
    body["schemaVersion"] = SCHEMA_VERSION
    file.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=r"routing\.prefixAwareness: unknown key"):
        load_config(file)

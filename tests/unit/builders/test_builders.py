"""Builders: golden manifests for every example, and the behaviour each example promises."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.api import DisaggregatedModel
from pdserve.builders import build_all, parity_hash
from pdserve.builders.gateway import routing_config
from pdserve.builders.vllm_args import kv_transfer_config
from pdserve.contract.names import PARITY_HASH_ANNOTATION
from pdserve.contract.routing import config_text_of
from pdserve.manifests import load_resources, render_manifests
from tests.support.specs import spec_with

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1"


def example(name: str) -> DisaggregatedModel:
    [dm] = load_resources(REPO / "examples" / f"{name}.yaml")
    return dm


def objects_by_key(dm: DisaggregatedModel) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in build_all(dm)}


def container(obj: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = obj["spec"]["template"]["spec"]["containers"][0]
    return result


def env_of(obj: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(obj)["env"]}


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_golden_manifests(path: Path) -> None:
    rendered = render_manifests(load_resources(path))
    golden = GOLDEN / f"{path.stem}.yaml"
    if UPDATE:
        golden.write_text(rendered)
    assert golden.exists(), f"no golden file: run PDSERVE_UPDATE_GOLDEN=1 pytest {__file__}"
    assert rendered == golden.read_text(), (
        f"{path.name} builds differently from {golden.name}; if intended, regenerate with "
        "PDSERVE_UPDATE_GOLDEN=1 and review the diff"
    )


def test_there_are_at_least_four_examples() -> None:
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_same_spec_gives_byte_identical_output(path: Path) -> None:
    assert render_manifests(load_resources(path)) == render_manifests(load_resources(path))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_pod_carries_one_parity_hash_and_selectors_match(path: Path) -> None:
    [dm] = load_resources(path)
    expected = parity_hash(dm)
    for obj in build_all(dm):
        assert obj["metadata"]["namespace"] == dm.namespace
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == dm.name
        if obj["kind"] in ("StatefulSet", "Deployment"):
            template = obj["spec"]["template"]
            assert template["metadata"]["annotations"][PARITY_HASH_ANNOTATION] == expected
            selector = obj["spec"]["selector"]["matchLabels"]
            assert selector.items() <= template["metadata"]["labels"].items()


def test_render_plus_1p1d_wires_scale_out_engines_and_nixl() -> None:
    dm = example("qwen2.5-7b-pd")
    objs = objects_by_key(dm)
    prefill, decode = (
        objs[("StatefulSet", "qwen25-7b-prefill")],
        objs[("StatefulSet", "qwen25-7b-decode")],
    )
    render = objs[("Deployment", "qwen25-7b-render")]

    for engine, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        args = container(engine)["args"]
        # The default engineApi, ScaleOut: the engines load the tokenizer, so they get the
        # text parity flags the render pool has.
        assert "--enable-scale-out" in args
        assert "--tokens-only" not in args
        assert flag_value(args, "--tool-call-parser") == "hermes"
        assert json.loads(flag_value(args, "--kv-transfer-config")) == {
            "kv_connector": "NixlConnector", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kv_lease_duration": 60},
        }  # fmt: skip
        env = env_of(engine)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        # No RDMA device in these pods: no NIC pin, which would leave UCX no transport.
        assert "UCX_NET_DEVICES" not in env
        assert env["PYTHONHASHSEED"] == "0"
        assert container(engine)["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert engine["spec"]["template"]["spec"]["nodeSelector"] == {
            "nvidia.com/gpu.product": "NVIDIA-H200"
        }

    render_args = container(render)["args"]
    assert container(render)["command"] == ["vllm", "launch", "render"]
    assert flag_value(render_args, "--tool-call-parser") == "hermes"
    assert "--enable-auto-tool-choice" in render_args
    assert flag_value(render_args, "--renderer-num-workers") == "2"
    assert "replicas" not in render["spec"]  # the HPA owns it
    assert "nodeSelector" not in render["spec"]["template"]["spec"]  # placement is for GPUs
    hpa = objs[("HorizontalPodAutoscaler", "qwen25-7b-render")]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)


def test_pd_without_render_runs_openai_engines_with_the_parity_flags() -> None:
    dm = example("pd-without-render")
    objs = objects_by_key(dm)
    assert not [k for k in objs if k[1].endswith("-render")]
    for pool in ("prefill", "decode"):
        engine = objs[("StatefulSet", f"llama-8b-pd-{pool}")]
        args = container(engine)["args"]
        assert "--tokens-only" not in args
        assert flag_value(args, "--tool-call-parser") == "llama3_json"
        assert env_of(engine)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert objs[("StatefulSet", "llama-8b-pd-prefill")]["spec"]["replicas"] == 2
    routing = json.loads(objs[("ConfigMap", "llama-8b-pd-gateway")]["data"]["routing.json"])
    assert routing["engineApi"] == "openai"
    assert "tokensEngines" not in routing  # no engines behind a render pool to describe
    assert routing["pools"]["render"] is None
    assert routing["routing"]["mode"] == "Disaggregated"


def test_render_with_one_tokens_only_pool_is_aggregated() -> None:
    dm = example("render-aggregated")
    objs = objects_by_key(dm)
    assert ("StatefulSet", "qwen3-8b-prefill") not in objs
    decode_args = container(objs[("StatefulSet", "qwen3-8b-decode")])["args"]
    assert "--kv-transfer-config" not in decode_args
    assert "--tokens-only" in decode_args  # engineApi: TokensOnly
    assert "--enable-scale-out" not in decode_args
    assert "--reasoning-parser" not in decode_args  # no tokenizer: text is the render pool's
    routing = json.loads(objs[("ConfigMap", "qwen3-8b-gateway")]["data"]["routing.json"])
    assert (routing["engineApi"], routing["tokensEngines"]) == ("tokens", "tokens_only")
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in env_of(objs[("StatefulSet", "qwen3-8b-decode")])
    render = objs[("Deployment", "qwen3-8b-render")]
    assert render["spec"]["replicas"] == 2
    assert ("HorizontalPodAutoscaler", "qwen3-8b-render") not in objs
    render_args = container(render)["args"]
    assert flag_value(render_args, "--default-chat-template-kwargs") == '{"enable_thinking":false}'
    assert flag_value(render_args, "--reasoning-parser") == "qwen3"


def test_tp2_prefill_with_two_decode_replicas() -> None:
    dm = example("tp2-prefill-2-decode")
    objs = objects_by_key(dm)
    prefill, decode = (
        objs[("StatefulSet", "qwq-32b-prefill")],
        objs[("StatefulSet", "qwq-32b-decode")],
    )
    assert container(prefill)["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(prefill)["volumeMounts"]
    assert "dshm" not in [v["name"] for v in decode["spec"]["template"]["spec"]["volumes"]]
    assert decode["spec"]["replicas"] == 2
    for engine in (prefill, decode):
        args = container(engine)["args"]
        assert args[0] == "/models/qwq-32b"
        assert flag_value(args, "--served-model-name") == "qwq"
        assert flag_value(args, "--kv-cache-dtype") == "fp8"
        assert flag_value(args, "--block-size") == "32"
        kv = json.loads(flag_value(args, "--kv-transfer-config"))
        # Bidirectional with no TTL set: pdserve's bounded default, not vLLM's 480 s.
        assert kv["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True,
                                                   "decoder_kv_blocks_ttl": 60}  # fmt: skip
        volume = engine["spec"]["template"]["spec"]["volumes"][0]
        assert volume == {
            "name": "model",
            "persistentVolumeClaim": {"claimName": "model-store", "readOnly": True},
        }
        assert env_of(engine)["HF_HUB_OFFLINE"] == "1"
        assert engine["spec"]["template"]["spec"]["imagePullSecrets"] == [
            {"name": "registry-creds"}
        ]
    render = objs[("Deployment", "qwq-32b-render")]
    # No render image set: vLLM's CPU image of the engine image's release.
    assert container(render)["image"] == "vllm/vllm-openai-cpu:v0.33.0"
    assert (
        flag_value(container(render)["args"], "--chat-template")
        == "/etc/pdserve/chat-template/template.jinja"
    )
    assert {"key": "template.jinja", "path": "template.jinja"} in next(
        v["configMap"]["items"] for v in render["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "chat-template"
    )  # fmt: skip
    assert container(decode)["args"][-1] == "--enable-prefix-caching"


BASE: dict[str, Any] = {
    "metadata": {"name": "m", "namespace": "ns"},
    "spec": {"model": {"name": "org/model"}, "prefill": {}},
}


def with_spec(**changes: Any) -> DisaggregatedModel:
    return spec_with(BASE, **changes)


@pytest.mark.parametrize(
    ("engine_api", "flag", "text_flags", "tokens_engines"),
    [
        (None, "--enable-scale-out", True, "scale_out"),
        ("ScaleOut", "--enable-scale-out", True, "scale_out"),
        ("TokensOnly", "--tokens-only", False, "tokens_only"),
    ],
)
def test_engines_behind_a_render_pool_run_what_engine_api_says(
    engine_api: str | None, flag: str, text_flags: bool, tokens_engines: str
) -> None:
    serving = {"toolCallParser": "hermes", "chatTemplate": {"name": "tpl", "key": "t.jinja"}}
    render = {} if engine_api is None else {"engineApi": engine_api}
    dm = with_spec(serving=serving, render=render)
    objs = objects_by_key(dm)
    for pool in ("prefill", "decode"):
        args = container(objs[("StatefulSet", f"m-{pool}")])["args"]
        other = {"--enable-scale-out", "--tokens-only"} - {flag}
        assert flag in args
        assert not other & set(args)
        assert ("--tool-call-parser" in args) is text_flags
        assert ("--chat-template" in args) is text_flags
    routing = json.loads(objs[("ConfigMap", "m-gateway")]["data"]["routing.json"])
    assert routing["tokensEngines"] == tokens_engines


def test_engines_without_a_render_pool_are_plain_openai_servers() -> None:
    objs = objects_by_key(with_spec(render={"enabled": False}))
    args = container(objs[("StatefulSet", "m-decode")])["args"]
    assert not {"--enable-scale-out", "--tokens-only"} & set(args)


def test_parity_hash_is_stable_for_the_same_set() -> None:
    assert parity_hash(with_spec()) == parity_hash(with_spec())
    # Pinned: a change here re-rolls every pod of every user on upgrade; do it on purpose only.
    # (Changed with serving.trustRemoteCode, in the release whose engine args roll pods anyway.)
    assert parity_hash(with_spec()) == "4a37d4a9c2f37afb"


@pytest.mark.parametrize(
    "change",
    [
        {"model__revision": "v2"},
        {"model__name": "org/other"},
        {"serving__tokenizer": "org/tok"},
        {"serving__tokenizerRevision": "r1"},
        {"serving__chatTemplate": {"name": "tpl", "key": "t.jinja"}},
        {"serving__defaultChatTemplateKwargs": {"enable_thinking": True}},
        {"serving__reasoningParser": "qwen3"},
        {"serving__toolCallParser": "hermes"},
        {"serving__blockSize": 32},
        {"serving__kvCacheDtype": "fp8"},
        {"serving__pythonHashSeed": 7},
        {"serving__trustRemoteCode": True},
        {"kvTransfer__connector": "LMCacheConnectorV1"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_any_parity_change_gives_a_new_hash(change: dict[str, Any]) -> None:
    assert parity_hash(with_spec(**change)) != parity_hash(with_spec())


@pytest.mark.parametrize(
    "change",
    [{"decode__replicas": 4}, {"image__engine": "vllm/vllm-openai:v0.34.0"},
     {"gateway__replicas": 3}, {"render__workers": 8}, {"render__engineApi": "TokensOnly"}],
    ids=lambda c: next(iter(c)),
)  # fmt: skip
def test_non_parity_changes_keep_the_hash(change: dict[str, Any]) -> None:
    assert parity_hash(with_spec(**change)) == parity_hash(with_spec())


def test_chat_template_content_is_part_of_the_hash() -> None:
    dm = with_spec(serving__chatTemplate={"name": "tpl", "key": "t.jinja"})
    assert parity_hash(dm, "digest-a") != parity_hash(dm, "digest-b")


def test_manifests_cli_prints_yaml_and_names_bad_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdserve.cli import main

    assert main(["manifests", "-f", str(EXAMPLES[0])]) == 0
    documents = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert {d["kind"] for d in documents} >= {"StatefulSet", "Service", "Deployment"}

    bad = tmp_path / "bad.yaml"
    spec = {"model": {"name": "m"}, "decode": {"replicas": -2}}
    bad.write_text(yaml.safe_dump({**BASE, "kind": "DisaggregatedModel", "spec": spec}))
    assert main(["manifests", "-f", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml (document 1, m): spec.decode.replicas: Input should be greater" in err


def test_simulator_example_requests_no_accelerator() -> None:
    dm = example("sim-qwen3")
    for obj in build_all(dm):
        if obj["kind"] == "StatefulSet":
            limits = container(obj)["resources"].get("limits", {})
            assert "nvidia.com/gpu" not in limits
            assert env_of(obj)["PDSERVE_SIM_REASONING"] == "1"
            assert container(obj)["image"] == "ghcr.io/pdserve/pdserve-sim:0.1.0"
            # What real vLLM on CPU would pick, so the example runs there too.
            assert flag_value(container(obj)["args"], "--block-size") == "128"


def test_other_accelerators_are_requested_by_name() -> None:
    dm = with_spec(placement={"acceleratorResource": "amd.com/gpu"},
                   decode={"tensorParallelSize": 2})  # fmt: skip
    decode = objects_by_key(dm)[("StatefulSet", "m-decode")]
    assert container(decode)["resources"]["limits"] == {"amd.com/gpu": "2"}


CPU_ENGINES = {"acceleratorResource": ""}


@pytest.mark.parametrize(
    ("placement", "block_size", "expected"),
    [
        ({}, None, 16),  # vLLM's GPU default
        ({"acceleratorResource": "amd.com/gpu"}, None, 16),
        (CPU_ENGINES, None, 128),  # vLLM's CPU default; its CPU backend refuses 16
        ({}, 16, 16),
        ({}, 8, 8),
        (CPU_ENGINES, 64, 64),
        (CPU_ENGINES, 32, 32),
    ],
)
def test_every_engine_and_the_gateway_get_the_effective_block_size(
    placement: dict[str, Any], block_size: int | None, expected: int
) -> None:
    """Always passed explicitly, so prefill and decode never fall back to defaults of their own;
    the gateway hashes prompts in the same blocks."""
    serving = {} if block_size is None else {"blockSize": block_size}
    dm = with_spec(placement=placement, serving=serving)
    assert dm.spec.block_size == expected
    objs = objects_by_key(dm)
    for name in ("m-prefill", "m-decode"):
        args = container(objs[("StatefulSet", name)])["args"]
        assert args.count("--block-size") == 1, args
        assert flag_value(args, "--block-size") == str(expected)
    assert "--block-size" not in container(objs[("Deployment", "m-render")])["args"]
    routing = json.loads(objs[("ConfigMap", "m-gateway")]["data"]["routing.json"])
    assert routing["blockSize"] == expected


def test_the_parity_hash_covers_the_effective_block_size_not_the_field() -> None:
    """An unset blockSize hashes as what it derives to: leaving the default or spelling it out is
    one parity set (no rollout), while moving the engines between CPU and accelerator changes the
    block size they run with, so it must change the hash too."""
    gpu, cpu = with_spec(), with_spec(placement=CPU_ENGINES)
    assert parity_hash(gpu) == parity_hash(with_spec(serving__blockSize=16))
    assert parity_hash(cpu) == parity_hash(with_spec(placement=CPU_ENGINES, serving__blockSize=128))
    assert parity_hash(cpu) != parity_hash(gpu)


def gateway_args(dm: DisaggregatedModel) -> list[str]:
    [deployment] = [o for o in build_all(dm) if o["kind"] == "Deployment"
                    and o["metadata"]["name"].endswith("-gateway")]  # fmt: skip
    args: list[str] = container(deployment)["args"]
    return args


def test_gateway_request_log_goes_to_its_container_log_only_when_asked() -> None:
    assert "--request-log" not in gateway_args(with_spec())
    args = gateway_args(with_spec(gateway__requestLog=True))
    assert args[args.index("--request-log") + 1] == "/dev/stdout"


def test_every_gateway_serves_clients_through_the_images_data_plane() -> None:
    args = gateway_args(with_spec())
    binary = args[args.index("--data-plane") + 1]
    assert binary == "/usr/local/bin/pdserve-dataplane"
    # The image puts it there: the Dockerfile's pdserve target copies the Go stage's binary.
    dockerfile = (Path(__file__).parents[3] / "images" / "Dockerfile").read_text()
    assert f"COPY --from=dataplane /out/pdserve-dataplane {binary}" in dockerfile


def test_kv_transfer_config_renders_the_buffer_device_and_the_decode_ttl() -> None:
    dm = with_spec(kvTransfer={"bidirectional": True, "decodeBlocksTtlSeconds": 900,
                               "kvBufferDevice": "cpu"})  # fmt: skip
    for role in ("kv_producer", "kv_consumer"):
        assert kv_transfer_config(dm, role) == {
            "kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"bidirectional_kv_xfer": True,
                                          "decoder_kv_blocks_ttl": 900},
        }  # fmt: skip
    # Unset: vLLM's default buffer device (cuda), so nothing is written; but the TTL is
    # pdserve's bounded default, never vLLM's 480 s (every P/D answer's KV held 8 minutes).
    assert kv_transfer_config(with_spec(kvTransfer={"bidirectional": True}), "kv_consumer") == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": 60},
    }  # fmt: skip
    routing = routing_config(with_spec(kvTransfer={"bidirectional": True}), "p")
    assert routing.kv_transfer.decode_blocks_ttl_seconds == 60
    # The buffer device is the connector's, not NIXL's alone.
    lmcache = with_spec(kvTransfer={"connector": "LMCacheConnectorV1", "kvBufferDevice": "cuda"})
    assert kv_transfer_config(lmcache, "kv_producer")["kv_buffer_device"] == "cuda"


def test_the_routing_config_carries_the_engines_lease_and_decode_ttl() -> None:
    """The gateway times KV leases on its own clock from these durations (an engine's expiry
    time is on the engine's clock): vLLM's defaults when the spec leaves them unset."""
    default = routing_config(with_spec(), "p").kv_transfer
    assert (default.prefill_lease_seconds, default.decode_blocks_ttl_seconds) == (30, 480)
    dm = with_spec(kvTransfer={"leaseDurationSeconds": 90, "bidirectional": True,
                               "decodeBlocksTtlSeconds": 900})  # fmt: skip
    text = json.loads(config_text_of(routing_config(dm, "p")))["kvTransfer"]
    assert (text["prefillLeaseSeconds"], text["decodeBlocksTtlSeconds"]) == (90, 900)
    assert "leaseDurationSeconds" not in text  # one key per duration

"""How engine, render and gateway pods live and die: vLLM's drain on SIGTERM within the grace
period, probe timeouts, default CPU/memory of GPU engines (BestEffort never), one NIXL port per
data-parallel rank, a capped /dev/shm, and the gateway's request timeout."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.api import DisaggregatedModel, SpecError
from pdserve.builders import build_all
from pdserve.gateway.settings import GatewaySettings
from tests.unit.builders.test_scaling_builders import model


def problems(**spec: Any) -> str:
    with pytest.raises(SpecError) as caught:
        model(**spec)
    return "; ".join(caught.value.problems)


def objects(dm: DisaggregatedModel) -> dict[str, Any]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in build_all(dm)}


def pod(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def container(obj: dict[str, Any]) -> dict[str, Any]:
    first: dict[str, Any] = pod(obj)["containers"][0]
    return first


def flag(obj: dict[str, Any], name: str) -> str:
    args: list[str] = container(obj)["args"]
    return args[args.index(name) + 1]


# --- vLLM drains on SIGTERM, within the grace period ---------------------------------------


def test_engines_drain_for_the_shutdown_timeout_inside_the_grace_period() -> None:
    built = objects(model(prefill={"replicas": 1, "drainSeconds": 10,
                                   "shutdownTimeoutSeconds": 300}))  # fmt: skip
    prefill, decode = built["StatefulSet/qwen-prefill"], built["StatefulSet/qwen-decode"]
    assert flag(prefill, "--shutdown-timeout") == "300"
    # The preStop drain, then vLLM's drain, then 30 s to stop its processes.
    assert pod(prefill)["terminationGracePeriodSeconds"] == 10 + 300 + 30
    assert flag(decode, "--shutdown-timeout") == "60"  # the default: vLLM's own (0) aborts
    assert pod(decode)["terminationGracePeriodSeconds"] == 5 + 60 + 30


def test_a_zero_shutdown_timeout_is_vllms_abort_and_still_written() -> None:
    decode = objects(model(decode={"shutdownTimeoutSeconds": 0}))["StatefulSet/qwen-decode"]
    assert flag(decode, "--shutdown-timeout") == "0"


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_shutdown_timeout_in_extra_args_points_to_the_field(pool: str) -> None:
    message = problems(**{pool: {"replicas": 1, "extraArgs": ["--shutdown-timeout=30"]}})
    assert message == (
        f"spec.{pool}.extraArgs[0] sets --shutdown-timeout, which is derived from "
        f"spec.{pool}.shutdownTimeoutSeconds; set it there instead"
    )


def test_the_render_pool_is_pointed_at_the_engine_pools_field() -> None:
    message = problems(render={"extraArgs": ["--tensor-parallel-size", "2"]})
    assert "spec.{prefill,decode}.tensorParallelSize" in message


def test_shutdown_timeout_is_bounded() -> None:
    assert "spec.decode.shutdownTimeoutSeconds: Input should be less than or equal to 3600" in (
        problems(decode={"shutdownTimeoutSeconds": 3601})
    )


# --- probes ----------------------------------------------------------------------------------


def test_every_probe_has_an_explicit_timeout() -> None:
    built = objects(model())
    for name in ("StatefulSet/qwen-prefill", "StatefulSet/qwen-decode",
                 "Deployment/qwen-render", "Deployment/qwen-gateway"):  # fmt: skip
        probes = {k: v for k, v in container(built[name]).items() if k.endswith("Probe")}
        assert probes["readinessProbe"]["timeoutSeconds"] == 2, name
        assert probes["livenessProbe"]["timeoutSeconds"] == 5, name
        if "startupProbe" in probes:
            assert probes["startupProbe"]["timeoutSeconds"] == 5, name


# --- engine resources ----------------------------------------------------------------------


def test_gpu_engines_request_cpu_and_memory_per_gpu_when_the_pool_sets_none() -> None:
    built = objects(model(prefill={"replicas": 1, "tensorParallelSize": 2,
                                   "dataParallelSize": 2}))  # fmt: skip
    prefill = container(built["StatefulSet/qwen-prefill"])["resources"]
    # The disk is the weights' download (Qwen3-8B from the Hub), not a per-GPU default.
    assert prefill == {"requests": {"cpu": "8", "memory": "64Gi", "ephemeral-storage": "19Gi"},
                       "limits": {"nvidia.com/gpu": "4"}}  # fmt: skip
    decode = container(built["StatefulSet/qwen-decode"])["resources"]
    assert decode["requests"] == {"cpu": "2", "memory": "16Gi", "ephemeral-storage": "19Gi"}


def test_what_the_pool_sets_is_kept_and_only_the_rest_is_defaulted() -> None:
    decode = objects(model(decode={"resources": {
        "requests": {"cpu": "500m"}, "limits": {"memory": "8Gi"},
    }}))["StatefulSet/qwen-decode"]  # fmt: skip
    # A memory limit alone: Kubernetes requests the limit, so no default request is added.
    assert container(decode)["resources"] == {
        "requests": {"cpu": "500m", "ephemeral-storage": "19Gi"},
        "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"},
    }


def test_cpu_engines_get_no_default_requests() -> None:
    decode = objects(model(placement={"acceleratorResource": ""}))["StatefulSet/qwen-decode"]
    assert "resources" not in container(decode) or not container(decode)["resources"]


def test_guaranteed_qos_makes_the_defaults_limits_too() -> None:
    built = objects(model(prefill={"replicas": 1, "tensorParallelSize": 2},
                          placement={"guaranteedQoS": True}))  # fmt: skip
    resources = container(built["StatefulSet/qwen-prefill"])["resources"]
    assert resources["requests"] == {"cpu": "4", "memory": "32Gi", "ephemeral-storage": "19Gi"}
    assert resources["limits"] == {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "2"}


# --- NIXL ports and /dev/shm -----------------------------------------------------------------


def test_one_nixl_port_per_data_parallel_rank_on_the_pod_and_its_service() -> None:
    built = objects(model(prefill={"replicas": 1, "dataParallelSize": 3},
                          kvTransfer={"sideChannelPort": 7000}))  # fmt: skip
    ports = {p["name"]: p["containerPort"]
             for p in container(built["StatefulSet/qwen-prefill"])["ports"]}  # fmt: skip
    assert ports == {"http": 8000, "nixl": 7000, "nixl-dp1": 7001, "nixl-dp2": 7002}
    service = {p["name"]: p["port"] for p in built["Service/qwen-prefill"]["spec"]["ports"]}
    assert service == ports
    decode = {p["name"] for p in container(built["StatefulSet/qwen-decode"])["ports"]}
    assert decode == {"http", "nixl"}


def test_side_channel_ports_past_65535_are_refused() -> None:
    message = problems(decode={"dataParallelSize": 4}, kvTransfer={"sideChannelPort": 65533})
    assert message.startswith("spec.kvTransfer.sideChannelPort 65533: NIXL listens on it plus")
    assert "spec.decode.dataParallelSize 4" in message
    assert "at most 65532" in message


def test_dev_shm_is_capped_per_gpu() -> None:
    built = objects(model(prefill={"replicas": 1, "tensorParallelSize": 4}))
    [shm] = [v for v in pod(built["StatefulSet/qwen-prefill"])["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert "dshm" not in [v["name"] for v in pod(built["StatefulSet/qwen-decode"])["volumes"]]


# --- the gateway's request timeout ---------------------------------------------------------


def test_the_gateway_request_timeout_reaches_its_command_line() -> None:
    gateway = objects(model(gateway={"requestTimeoutSeconds": 1800}))["Deployment/qwen-gateway"]
    assert flag(gateway, "--request-timeout-seconds") == "1800"
    default = objects(model())["Deployment/qwen-gateway"]
    assert float(flag(default, "--request-timeout-seconds")) == GatewaySettings().request_timeout


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, "greater than or equal to 1"), (86401, "less than or equal to 86400")],
)
def test_the_gateway_request_timeout_is_bounded(value: int, expected: str) -> None:
    message = problems(gateway={"requestTimeoutSeconds": value})
    assert message.startswith(f"spec.gateway.requestTimeoutSeconds: Input should be {expected}")


def test_a_hub_download_is_sized_from_the_model_and_asks_for_the_disk() -> None:
    """Qwen3-8B: 8.19e9 parameters x 2 bytes x 1.2 headroom = 18.3 GiB -> 19Gi, on engines
    only; an unknown model gets no size."""
    built = objects(model())
    engines = [o for k, o in built.items() if k.startswith("StatefulSet/")]
    assert len(engines) == 2
    for engine in engines:
        [cache] = [v for v in pod(engine)["volumes"] if v["name"] == "hf-cache"]
        assert cache["emptyDir"] == {"sizeLimit": "19Gi"}
        requests = pod(engine)["containers"][0]["resources"]["requests"]
        assert requests["ephemeral-storage"] == "19Gi"
    # Render runs as a non-root user: the tokenizer's download lands in its HOME's emptyDir.
    render = pod(built["Deployment/qwen-render"])
    [home] = [v for v in render["volumes"] if v["name"] == "home"]
    assert home["emptyDir"] == {}
    assert {"name": "HOME", "value": "/home/pdserve"} in render["containers"][0]["env"]
    assert {"name": "home", "mountPath": "/home/pdserve"} in render["containers"][0]["volumeMounts"]
    for key, obj in objects(model(model={"name": "acme/secret-70b"})).items():
        if key.startswith("StatefulSet/"):
            assert "ephemeral-storage" not in pod(obj)["containers"][0]["resources"]["requests"]


@pytest.mark.parametrize(
    ("cache", "volume"),
    [({"claimName": "hf-cache"}, {"persistentVolumeClaim": {"claimName": "hf-cache"}}),
     ({"hostPath": "/var/lib/hf"}, {"hostPath": {"path": "/var/lib/hf",
                                                 "type": "DirectoryOrCreate"}})],
    ids=["claim", "hostPath"],
)  # fmt: skip
def test_a_model_cache_holds_the_engines_download_across_pod_starts(
    cache: dict[str, str], volume: dict[str, Any]
) -> None:
    """Weights downloaded once into the cache instead of each pod's emptyDir: the engines
    mount it where Hugging Face keeps its downloads and ask the node for no disk for them."""
    built = objects(model(model={"name": "Qwen/Qwen3-8B", "source": {"hf": {"cache": cache}}}))
    for key in ("StatefulSet/qwen-prefill", "StatefulSet/qwen-decode"):
        [hub] = [v for v in pod(built[key])["volumes"] if v["name"] == "hf-cache"]
        assert hub == {"name": "hf-cache", **volume}
        assert {"name": "hf-cache", "mountPath": "/root/.cache/huggingface"} in container(
            built[key]
        )["volumeMounts"]
        assert "ephemeral-storage" not in container(built[key])["resources"].get("requests", {})
    # Render fetches the tokenizer files only, into its own HOME (it runs as another user).
    render = pod(built["Deployment/qwen-render"])
    assert [v["name"] for v in render["volumes"]] == ["home"]


def test_a_model_cache_names_exactly_one_place() -> None:
    message = problems(model={"name": "m", "source": {"hf": {"cache": {}}}})
    assert "spec.model.source.hf.cache: set exactly one of claimName and hostPath" in message

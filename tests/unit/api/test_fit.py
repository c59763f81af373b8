"""Each engine pool must fit every GPU product placement allows: weights per GPU plus one
full-length sequence of KV within gpuMemoryUtilization, else the spec is refused before any pod
exists, with the numbers and the fixes."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.api import parse_resource
from pdserve.api.fit import GIB, fit_warnings, fits
from tests.unit.api.test_api import problems, resource

LLAMA_70B = {"name": "meta-llama/Llama-3.1-70B-Instruct"}
TP2 = {"tensorParallelSize": 2}


def llama(products: list[str], **spec: Any) -> dict[str, Any]:
    return resource(**{
        "model": LLAMA_70B, "prefill": TP2, "decode": TP2,
        "placement": {"gpuProducts": products}, **spec,
    })  # fmt: skip


def test_llama_70b_at_tp2_on_h100_is_refused_with_the_numbers_and_the_fixes() -> None:
    [problem] = problems(llama(["NVIDIA-H200", "NVIDIA-H100-80GB-HBM3"]))
    prefill, decode = problem.split("; spec.decode")
    assert prefill.startswith("spec.prefill: meta-llama/Llama-3.1-70B-Instruct does not fit")
    assert "spec.decode" + decode == (
        "spec.decode: meta-llama/Llama-3.1-70B-Instruct does not fit NVIDIA-H100-80GB-HBM3 "
        "(79.6 GiB, 71.7 GiB at gpuMemoryUtilization 0.9): 65.8 GiB of weights per GPU at "
        "tensorParallelSize 2 leave 5.9 GiB for KV, and one 131072-token sequence (the model's "
        "own context) needs 20.0 GiB; vLLM would refuse to start. Fix: raise "
        "spec.decode.tensorParallelSize to 4, or lower spec.model.maxModelLen to 25600 or less, "
        "or take NVIDIA-H100-80GB-HBM3 out of spec.placement.gpuProducts"
    )


@pytest.mark.parametrize(
    "spec",
    [
        llama(["NVIDIA-H200"]),
        llama(["NVIDIA-H100-80GB-HBM3"], prefill={"tensorParallelSize": 4},
              decode={"tensorParallelSize": 4}),
        llama(["NVIDIA-H100-80GB-HBM3"], model={**LLAMA_70B, "maxModelLen": 16384}),
        llama(["NVIDIA-H100-80GB-HBM3"], serving={"kvCacheDtype": "fp8"},
              model={**LLAMA_70B, "maxModelLen": 32768}),
    ],
    ids=["h200", "h100-tp4", "h100-16k", "h100-fp8-kv-32k"],
)  # fmt: skip
def test_the_same_model_fits_where_the_numbers_allow(spec: dict[str, Any]) -> None:
    dm = parse_resource(spec)
    assert all(f.fits for f in fits(dm.spec))


def test_what_is_not_known_is_not_judged() -> None:
    unknown_model = llama(["NVIDIA-H100-80GB-HBM3"], model={"name": "acme/secret-70b"})
    unknown_product = llama(["NVIDIA-B300-SXM6-AC"])
    any_gpu = resource(model=LLAMA_70B, prefill=TP2, decode=TP2)
    for spec in (unknown_model, unknown_product, any_gpu):
        assert fits(parse_resource(spec).spec) == []


def test_a_shape_given_in_the_spec_is_judged_like_a_known_one() -> None:
    shape = {"parametersBillions": 70.6, "layers": 80, "kvHeads": 8, "headDim": 128,
             "contextLength": 131072}  # fmt: skip
    found = problems(llama(["NVIDIA-L40S"], model={"name": "acme/llama-70b-ft", "shape": shape}))
    assert found[0].startswith("spec.prefill: acme/llama-70b-ft does not fit NVIDIA-L40S")
    assert "raise spec.prefill.tensorParallelSize" not in found[0]  # 4 L40S cannot hold it


def test_a_fit_without_room_for_activations_is_a_warning() -> None:
    # 2.7 GiB of KV per 16k tokens at TP2 on H100: about 1 GiB spare at maxModelLen 36864.
    dm = parse_resource(llama(["NVIDIA-H100-80GB-HBM3"], model={**LLAMA_70B, "maxModelLen": 36864}))
    [fit] = {f.spare for f in fits(dm.spec)}
    assert 0 < fit < 2 * GIB
    [first, second] = fit_warnings(dm.spec)
    assert first.startswith("spec.prefill: meta-llama/Llama-3.1-70B-Instruct on ")
    assert "may refuse to start" in second


def test_a_pod_wider_than_every_node_of_its_product_is_refused() -> None:
    spec = resource(model={"name": "Qwen/Qwen3-0.6B"}, prefill={"tensorParallelSize": 8},
                    placement={"gpuProducts": ["NVIDIA-GB200"]})  # fmt: skip
    [problem] = problems(spec)
    assert problem == (
        "spec.prefill: tensorParallelSize 8 x dataParallelSize 1 = 8 GPUs in one pod, but every "
        "NVIDIA-GB200 node has 4 and a pod cannot span nodes, so it would stay Pending. Fix: "
        "lower spec.prefill.tensorParallelSize or dataParallelSize to 4 GPUs per pod (more "
        "replicas instead), or take NVIDIA-GB200 out of spec.placement.gpuProducts"
    )
    # PCIe servers hold different counts: an 8-GPU L40S pod is left to the scheduler.
    wide_l40s = resource(model={"name": "Qwen/Qwen3-0.6B"}, prefill={"tensorParallelSize": 8},
                         placement={"gpuProducts": ["NVIDIA-L40S"]})  # fmt: skip
    parse_resource(wide_l40s)

"""The GPU product catalogue: GFD's label values, one entry per product."""

from __future__ import annotations

import re

from pdserve.api.gpu_products import CATALOGUE, lookup, never_in_a_clique

# GFD's product label: NVML's name with characters outside [A-Za-z0-9-_. ] dropped, blanks -> "-".
GFD_PRODUCT = re.compile(r"^[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*$")


def test_every_entry_is_keyed_by_its_label_and_plausible() -> None:
    assert len({p.product for p in CATALOGUE.values()}) == len(CATALOGUE)
    for key, product in CATALOGUE.items():
        assert key == product.product
        assert GFD_PRODUCT.match(product.product), product.product
        assert product.memory_mib > 0
        assert product.gpus_per_node > 0
        assert product.source


def test_only_multi_node_nvlink_products_carry_a_clique() -> None:
    assert never_in_a_clique("NVIDIA-H200")
    assert never_in_a_clique("NVIDIA-H100-80GB-HBM3")
    assert never_in_a_clique("NVIDIA-L40S")
    assert not never_in_a_clique("NVIDIA-GB200")
    assert not never_in_a_clique("NVIDIA-Unknown")  # unknown products are not judged
    assert lookup("NVIDIA-Unknown") is None

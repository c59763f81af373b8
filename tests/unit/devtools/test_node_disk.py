"""The real node refuses to import images its disk cannot hold, before containerd starts
writing: a full disk otherwise shows much later as pods stuck in CreateContainerError."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from devtools.nodehost import NodeError
from devtools.realnode import GIB, ensure_room_for


def free_bytes(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    usage = shutil.disk_usage("/")

    def disk_usage(path: Any) -> Any:
        return usage._replace(free=free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_an_image_needs_room_for_its_layers_and_their_unpacked_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "vllm-cpu.tar"
    with archive.open("wb") as out:
        out.truncate(3 * GIB)  # sparse: the size is what counts
    free_bytes(monkeypatch, 7 * GIB)
    with pytest.raises(NodeError) as refused:
        ensure_room_for(tmp_path, [archive])
    assert "needs about 8.0 GiB free" in str(refused.value)
    assert "vllm-cpu.tar" in str(refused.value)
    assert "7.0 GiB are free" in str(refused.value)
    free_bytes(monkeypatch, 8 * GIB)
    ensure_room_for(tmp_path, [archive])

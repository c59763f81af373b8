"""The side-by-side data plane tool refuses what it cannot run, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools import dataplane_ab


def test_a_binary_that_is_not_there_is_named_and_nothing_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "pdserve-dataplane"
    assert dataplane_ab.main([str(missing)]) == 2
    assert f"no such data plane binary: {missing}" in capsys.readouterr().err


def test_the_prompt_sizes_are_the_benchmarks_own() -> None:
    with pytest.raises(SystemExit):
        dataplane_ab.parser().parse_args(["x", "--prompt", "3KB"])


def test_half_load_with_a_rate_is_refused_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "pdserve-dataplane"
    binary.write_text("")
    assert dataplane_ab.main([str(binary), "--half-load", "--rate", "4000"]) == 2
    assert "--half-load sets each target's rate itself: drop --rate" in capsys.readouterr().err

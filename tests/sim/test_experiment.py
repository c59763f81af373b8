"""The article experiment runs end to end (tiny and fast here; `pdserve sim experiment article`
with its defaults is the real measurement) and prints the comparison table."""

from __future__ import annotations

import pytest

from pdserve.bench.stats import percentile
from pdserve.sim.experiment import main


def test_percentile_interpolates_like_numpy_and_vllm_bench() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # order does not matter
    assert percentile(values, 99) == pytest.approx(99.01)  # numpy.percentile(1..100, 99)
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0


def test_experiment_prints_sim_and_article_figures(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--rates", "0.4", "--requests", "3", "--prompt-len", "256", "--output-len", "8",
            "--time-scale", "0.02"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| rate req/s | metric | DP=2 sim | DP=2 article | 1P1D sim | 1P1D article |" in out
    p99 = next(line for line in out.splitlines() if line.startswith("| 0.4 | p99 ITL ms |"))
    cells = [c.strip() for c in p99.strip("|").split("|")]
    assert cells[3] == "169"
    assert cells[5] == "29"
    assert float(cells[2]) > 0
    assert float(cells[4]) > 0

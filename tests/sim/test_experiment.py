"""The article experiment runs end to end (tiny and fast here; `pdserve sim experiment article`
with its defaults is the real measurement) and prints the comparison table."""

from __future__ import annotations

import pytest

from pdserve.sim.experiment import main


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

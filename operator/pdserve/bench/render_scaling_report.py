"""render_scaling's report: per policy the latency it held and the replicas it paid for, as
Markdown tables and a PNG."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.render_scaling_model import Cost, Run, Scenario, p99


@dataclass(frozen=True)
class Summary:
    policy: str
    p99_all: float
    p99_ramp: float
    within: float  # share of windows whose p99 met the target
    worst: float
    token_p99: float
    max_replicas: int
    replica_minutes: float
    calls: int


def summarize(run: Run, scenario: Scenario) -> Summary:
    ramp = (2 * 60 * scenario.minutes / 20, 12 * 60 * scenario.minutes / 20)
    everything = [s for _, s in run.latencies]
    during = [s for t, s in run.latencies if ramp[0] <= t < ramp[1]]
    measured = [w for w in run.windows if w.p99 is not None]
    return Summary(
        policy=run.policy,
        p99_all=p99(everything) or 0.0,
        p99_ramp=p99(during) or 0.0,
        within=sum(1 for w in measured if (w.p99 or 0) <= scenario.target_p99) / len(measured),
        worst=max(w.p99 or 0 for w in measured),
        token_p99=p99(run.token_delays) or 0.0,
        max_replicas=max(w.replicas for w in run.windows),
        replica_minutes=run.replica_seconds / 60,
        calls=len(everything),
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


def calibration_text(cost: Cost, scenario: Scenario) -> str:
    return (
        f"Calibrated on the simulator's render server: one streamed derender call costs "
        f"{cost.base * 1000:.3f} ms + {cost.per_token * 1e6:.3f} us per token of history "
        f"(a {scenario.shape(0)[1]}-token stream derendered per token: "
        f"{cost.stream(scenario.shape(0)[1]):.2f} s of handler time; an 8000-token one: "
        f"{cost.stream(8000):.1f} s). Target: p99 derender call latency <= "
        f"{ms(scenario.target_p99)} per {scenario.interval:g} s window. Pool: "
        f"{scenario.min_replicas}-{scenario.max_replicas} replicas, one worker each, new pods "
        f"ready after {scenario.startup:g} s.\n"
    )


def markdown(
    scenario: Scenario, summaries: Sequence[Summary], runs: Sequence[Run], plot: str
) -> str:
    lines = [
        "| policy | p99 derender, whole run | p99, minutes 2-12 (load) | windows within target | "
        "worst window p99 | p99 token delay | most replicas | replica-minutes | calls |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summaries:
        lines.append(
            f"| {s.policy} | {ms(s.p99_all)} | {ms(s.p99_ramp)} | {s.within:.0%} | "
            f"{ms(s.worst)} | {ms(s.token_p99)} | {s.max_replicas} | {s.replica_minutes:.0f} | "
            f"{s.calls:,} |"
        )
    lines += ["", "Replicas (ready) per minute, and the cores the live streams would need with a "
              "derender call per token:", ""]  # fmt: skip
    header = "| minute | demand, cores | " + " | ".join(r.policy for r in runs) + " |"
    lines += [header, "|" + " --- |" * (2 + len(runs))]
    per_minute = max(1, round(60 / scenario.interval))
    for index in range(per_minute - 1, len(runs[0].windows), per_minute):
        window = runs[0].windows[index]
        cells = [f"{run.windows[index].replicas}" if index < len(run.windows) else "-"
                 for run in runs]  # fmt: skip
        lines.append(f"| {window.t / 60:.0f} | {window.demand:.1f} | " + " | ".join(cells) + " |")
    if plot:
        lines += ["", f"![render replicas and p99 derender latency per policy]({plot})"]
    return "\n".join(lines) + "\n"


def draw(runs: Sequence[Run], scenario: Scenario, path: Path) -> bool:
    """A PNG of replicas and p99 latency per window; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    minutes = [w.t / 60 for w in runs[0].windows]
    top.plot(minutes, [w.demand / 0.7 for w in runs[0].windows], color="grey", linestyle=":",
             label="parser demand / 70% (per-token calls)")  # fmt: skip
    for run in runs:
        top.step([w.t / 60 for w in run.windows], [w.replicas for w in run.windows], where="post",
                 label=run.policy)  # fmt: skip
        bottom.plot([w.t / 60 for w in run.windows],
                    [(w.p99 or 0) * 1000 for w in run.windows], label=run.policy)  # fmt: skip
    bottom.axhline(scenario.target_p99 * 1000, color="black", linestyle="--", label="target")
    top.set_ylabel("ready render replicas")
    top.legend(fontsize=8)
    bottom.set_yscale("log")
    bottom.set_ylabel("p99 derender call, ms")
    bottom.set_xlabel("minute")
    bottom.legend(fontsize=8)
    top.set_title(f"Streamed reasoning, {scenario.plan}: render pool per autoscaling policy")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return True

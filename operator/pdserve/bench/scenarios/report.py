"""A scenario's report section and where it goes: between its markers in the Markdown report."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.scenarios.points import Options
from pdserve.bench.scenarios.tables import chart_dir, images


@dataclass
class Section:
    name: str
    title: str
    body: list[str]
    charts: list[str] = field(default_factory=list)
    time_scales: str | None = None
    """Overrides the run's time scale in the report's header."""


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def render_section(section: Section, command: str, options: Options) -> str:
    scales = section.time_scales or f"time scale {options.time_scale:g}"
    meta = (
        f"Reproduce: `{command}` ({scales}; times are simulated ms; from scratch about "
        f"{minutes(options.point_seconds)} of wall time on a 2-core machine shared with other "
        "work)."
    )
    parts = [f"## {section.title}", "", meta, "", *section.body]
    if section.charts:
        parts += ["", images(section.charts, chart_dir(options).name)]
    return "\n".join([f"<!-- bench:{section.name} -->", *parts, f"<!-- /bench:{section.name} -->"])


def write_section(path: Path, block: str, name: str) -> None:
    """Replace the scenario's block between its markers, or append it."""
    text = path.read_text() if path.exists() else "# pdserve benchmarks\n"
    pattern = re.compile(rf"<!-- bench:{name} -->.*?<!-- /bench:{name} -->", re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)

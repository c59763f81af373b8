"""Print the requirements of one of pdserve's extras (pyproject.toml), space-separated, for an
install that must skip their own dependencies (`pip install --no-deps $(...)`): NIXL's wheels
require torch, which the KV probe does not use. One place for the versions: the extra.

    python devtools/extra_requirements.py nixl [path/to/pyproject.toml]
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def extra_requirements(extra: str, pyproject: Path) -> list[str]:
    with pyproject.open("rb") as handle:
        extras: dict[str, list[str]] = tomllib.load(handle)["project"]["optional-dependencies"]
    if extra not in extras:
        raise SystemExit(f"{pyproject}: no extra {extra!r}; the extras are {sorted(extras)}")
    return extras[extra]


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[1] / "pyproject.toml"
    path = Path(sys.argv[2]) if len(sys.argv) > 2 else default
    print(" ".join(extra_requirements(sys.argv[1], path)))

"""Marking every test of a package with its layer's marker from the package's conftest, so a
test file cannot forget it (`make test-unit` deselects by marker)."""

from __future__ import annotations

from pathlib import Path

import pytest


def mark_package(items: list[pytest.Item], conftest: str, marker: pytest.MarkDecorator) -> None:
    here = Path(conftest).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(marker)

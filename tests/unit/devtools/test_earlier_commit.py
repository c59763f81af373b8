"""The previous release's commit, which the upgrade test builds, is found in a shallow clone
too (CI may clone with --depth 1): its history is fetched from the clone's origin."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from devtools.images import EARLIER_COMMIT, ROOT, ImageBuildError, resolve_commit


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def test_a_shallow_clone_fetches_the_history_that_holds_the_earlier_commit(
    tmp_path: Path,
) -> None:
    if git("-C", str(ROOT), "rev-parse", "--is-shallow-repository").strip() == "true":
        git("-C", str(ROOT), "fetch", "--quiet", "--unshallow")
    clone = tmp_path / "shallow"
    git("clone", "--quiet", "--depth", "1", f"file://{ROOT}", str(clone))
    assert git("-C", str(clone), "rev-parse", "--is-shallow-repository").strip() == "true"
    assert resolve_commit(clone, EARLIER_COMMIT[:12]) == EARLIER_COMMIT
    assert git("-C", str(clone), "rev-parse", "--is-shallow-repository").strip() == "false"


def test_a_commit_nobody_has_is_refused_naming_it() -> None:
    with pytest.raises(ImageBuildError, match="0123456789ab"):
        resolve_commit(ROOT, "0123456789ab" * 3 + "0123")

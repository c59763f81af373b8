"""One builder at a time per cache entry: two test runs (or `make` and a test) that both find a
cache entry missing must not build it into the same directory at once."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def cache_lock(entry: Path) -> Iterator[None]:
    """Hold an exclusive lock beside `entry` (`<entry>.lock`) until the block ends; a second
    holder waits. The caller checks again, inside, whether the entry was built meanwhile."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with entry.with_name(entry.name + ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

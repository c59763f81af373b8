"""Two builders of one cache entry: the second waits for the first, then finds it built."""

from __future__ import annotations

import threading
from pathlib import Path

from devtools.cachelock import cache_lock


def test_a_second_holder_waits_for_the_first(tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    order: list[str] = []
    first_in = threading.Event()
    release = threading.Event()

    def first() -> None:
        with cache_lock(entry):
            order.append("first in")
            first_in.set()
            release.wait(10)
            order.append("first out")

    def second() -> None:
        first_in.wait(10)
        with cache_lock(entry):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    first_in.wait(10)
    # The second thread is blocked on the lock now or about to be; either way it cannot get in
    # before the first leaves.
    release.set()
    for thread in threads:
        thread.join(10)
    assert order == ["first in", "first out", "second in"]

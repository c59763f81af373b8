"""Go programs shipped as source are built once per source version, and a build another process
finds is whole: a half-written binary run by a second process (a second pytest run beside the
first, say) would fail with an exec error instead of serving."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pdserve.gobuild import GoUnavailable, built, source_digest

HELLO = 'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("hi") }\n'


def program(tmp_path: Path, main: str) -> Path:
    source = tmp_path / "hello"
    source.mkdir()
    (source / "go.mod").write_text("module example.com/hello\n\ngo 1.22\n")
    (source / "main.go").write_text(main)
    return source


def test_builds_at_once_give_one_whole_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pdserve.gobuild.cache_root", lambda: tmp_path / "cache")
    source = program(tmp_path, HELLO)
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: built(source, ["."], "hello"), range(2))
    assert first == second
    ran = subprocess.run([first / "hello"], capture_output=True, text=True, check=True)
    assert ran.stdout == "hi\n"
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # nothing left half-built


def test_nothing_is_at_the_programs_path_until_it_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pdserve.gobuild.cache_root", lambda: tmp_path / "cache")
    source = program(tmp_path, HELLO)
    final = tmp_path / "cache" / "hello" / source_digest(source)
    seen_while_writing: list[bool] = []
    run = subprocess.run

    def go(*args: Any, **kwargs: Any) -> Any:
        done = run(*args, **kwargs)  # the bytes are written: the program is not known whole yet
        seen_while_writing.append((final / "hello").exists())
        return done

    monkeypatch.setattr("pdserve.gobuild.subprocess.run", go)
    assert built(source, ["."], "hello") == final
    assert (final / "hello").exists()
    assert seen_while_writing == [False]  # only beside, under a name no one looks for


def test_a_failed_build_says_why_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pdserve.gobuild.cache_root", lambda: tmp_path / "cache")
    source = program(tmp_path, "package main\n\nfunc main() { missing() }\n")
    with pytest.raises(GoUnavailable, match="undefined: missing"):
        built(source, ["."], "hello")
    assert list((tmp_path / "cache" / "hello").iterdir()) == []

"""The images' Python dependencies come from locks with hashes (images/*.lock, `make lock`):
every input requirement is pinned there, at a version it accepts, with a file hash, and the
Dockerfile installs each lock with --require-hashes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from devtools.pylock import IMAGES, Lock, locks, requirements_text

# The images' interpreter and platform (Debian 12's CPython 3.11 on x86_64).
IMAGE_ENVIRONMENT = {"python_version": "3.11", "python_full_version": "3.11.2",
                     "sys_platform": "linux", "platform_system": "Linux",
                     "platform_machine": "x86_64", "implementation_name": "cpython"}  # fmt: skip
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+) \\$")


def pins(path: Path) -> dict[str, tuple[Version, list[str]]]:
    """name -> (version, hashes) from a lock in pip's requirements format."""
    found: dict[str, tuple[Version, list[str]]] = {}
    current: list[str] = []
    for line in path.read_text().splitlines():
        if match := PIN.match(line):
            current = []
            found[canonicalize_name(match[1])] = (Version(match[2]), current)
        elif line.strip().startswith("--hash=sha256:"):
            current.append(line.strip().removesuffix(" \\").removeprefix("--hash=sha256:"))
    return found


@pytest.mark.parametrize("lock", locks(), ids=lambda lock: lock.path.name)
def test_every_input_is_pinned_at_a_version_it_accepts_with_a_hash(lock: Lock) -> None:
    pinned = pins(lock.path)
    assert pinned, f"{lock.path.name} pins nothing: run `make lock`"
    for name, (_, hashes) in pinned.items():
        assert hashes, f"{name} has no hash in {lock.path.name}"
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), name
    for spec in lock.inputs:
        requirement = Requirement(spec)
        if requirement.marker and not requirement.marker.evaluate(IMAGE_ENVIRONMENT):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{spec} is not in {lock.path.name}: run `make lock`"
        version, _ = pinned[name]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{lock.path.name} pins {name}=={version}, outside {spec}: run `make lock`"
        )


def test_a_lock_is_written_with_every_files_hash_sorted_by_name() -> None:
    lock = Lock(IMAGES / "x.lock", ("b>=1", "a"), with_dependencies=False)
    pylock = {"packages": [
        {"name": "b", "version": "1.2", "wheels": [{"hashes": {"sha256": "2" * 64}},
                                                   {"hashes": {"sha256": "1" * 64}}]},
        {"name": "a", "version": "3", "sdist": {"hashes": {"sha256": "3" * 64}}},
    ]}  # fmt: skip
    text = requirements_text(pylock, lock)
    assert text.splitlines()[1].startswith("# Installed with --require-hashes --no-deps")
    assert text.splitlines()[2:] == [
        "a==3 \\", f"    --hash=sha256:{'3' * 64}",
        "b==1.2 \\", f"    --hash=sha256:{'1' * 64} \\", f"    --hash=sha256:{'2' * 64}",
    ]  # fmt: skip


def test_the_dockerfile_installs_every_lock_requiring_hashes() -> None:
    text = (IMAGES / "Dockerfile").read_text()
    for lock in locks():
        assert f"images/{lock.path.name}" in text, lock.path.name
    installs = re.findall(r"pip install[^\n]*-r \S+\.lock", text)
    assert len(installs) == len(locks()), installs
    assert all("--require-hashes" in install for install in installs), installs
    # pdserve's own wheel, built from this tree, goes in last and resolves nothing.
    assert re.search(r"pip install [^\n]*--no-deps [^\n]*/wheels/\*\.whl", text)

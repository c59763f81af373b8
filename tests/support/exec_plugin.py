"""A scripted kubeconfig exec credential plugin: a Python script (run by this interpreter) that
prints the next step of its plan, counts its runs and keeps each run's KUBERNETES_EXEC_INFO."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

V1 = "client.authentication.k8s.io/v1"
V1BETA1 = "client.authentication.k8s.io/v1beta1"

_SCRIPT = """\
import json, os, pathlib, sys

here = pathlib.Path(__file__).parent
counter = here / "runs"
run = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(run + 1))
(here / f"exec-info-{run}.json").write_text(os.environ.get("KUBERNETES_EXEC_INFO", ""))
(here / f"env-{run}.json").write_text(json.dumps(dict(os.environ)))
plan = json.loads((here / "plan.json").read_text())
step = plan[min(run, len(plan) - 1)]
sys.stderr.write(step.get("stderr", ""))
if "stdout" in step:
    sys.stdout.write(step["stdout"])
else:
    print(json.dumps(step["credential"]))
sys.exit(step.get("exit", 0))
"""


def credential(
    token: str | None, expires: datetime | None = None, *, api_version: str = V1, **status: Any
) -> dict[str, Any]:
    """An ExecCredential as a plugin prints it."""
    if token is not None:
        status["token"] = token
    if expires is not None:
        status["expirationTimestamp"] = expires.isoformat().replace("+00:00", "Z")
    return {"apiVersion": api_version, "kind": "ExecCredential", "status": status}


class ScriptedPlugin:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.script = directory / "plugin.py"
        self.script.write_text(_SCRIPT)

    def plan(self, *steps: dict[str, Any]) -> None:
        """Run n prints step n (the last one for every later run). A step: `credential` (an
        ExecCredential, printed as JSON) or `stdout`, and optionally `stderr`, `exit`."""
        (self.directory / "plan.json").write_text(json.dumps(list(steps)))

    def answer(self, *credentials: dict[str, Any]) -> None:
        self.plan(*({"credential": c} for c in credentials))

    @property
    def runs(self) -> int:
        counter = self.directory / "runs"
        return int(counter.read_text()) if counter.exists() else 0

    def exec_info(self, run: int) -> dict[str, Any]:
        info: dict[str, Any] = json.loads((self.directory / f"exec-info-{run}.json").read_text())
        return info

    def env(self, run: int) -> dict[str, str]:
        env: dict[str, str] = json.loads((self.directory / f"env-{run}.json").read_text())
        return env

    def exec_section(self, api_version: str = V1, **extra: Any) -> dict[str, Any]:
        """The kubeconfig's `users[].user.exec` that runs this plugin."""
        section: dict[str, Any] = {
            "apiVersion": api_version,
            "command": sys.executable,
            "args": [str(self.script)],
            "interactiveMode": "Never",
        }
        return {**section, **extra}


def with_exec_user(kubeconfig: Path, out: Path, exec_section: dict[str, Any]) -> str:
    """`kubeconfig` with its current user's credentials replaced by `exec_section`, written to
    `out`; returns the token the user had."""
    config = yaml.safe_load(kubeconfig.read_text())
    user_name = next(
        c["context"]["user"] for c in config["contexts"] if c["name"] == config["current-context"]
    )
    [user] = [u for u in config["users"] if u["name"] == user_name]
    token: str = user["user"]["token"]
    user["user"] = {"exec": exec_section}
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    out.chmod(0o600)
    return token


def write_kubeconfig(
    path: Path, *, server: str, user: dict[str, Any], cluster: dict[str, Any] | None = None
) -> Path:
    """A one-context kubeconfig: `user` is its `users[].user`, `cluster` more of its cluster."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, **(cluster or {})}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "ctx",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path

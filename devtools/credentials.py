"""How the local plane's users authenticate: the API server's static token file and one
kubeconfig per user. Every user is in `system:masters`; tokens are random per plane, and the
files are readable by their owner only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml

CLUSTER_NAME = "pdserve-local"


def write_token_file(path: Path, tokens: Mapping[str, str]) -> None:
    """kube-apiserver's --token-auth-file: token,user,uid,"groups"; readable by us only."""
    rows = [f'{token},{user},uid-{user},"system:masters"' for user, token in tokens.items()]
    path.write_text("\n".join(rows) + "\n")
    path.chmod(0o600)


def write_kubeconfig(path: Path, *, server: str, ca_file: Path, user: str, token: str) -> None:
    """A kubeconfig for ``user`` alone, namespace `default`; readable by us only."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CLUSTER_NAME,
                "cluster": {"server": server, "certificate-authority": str(ca_file)},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {
                "name": f"{user}@{CLUSTER_NAME}",
                "context": {"cluster": CLUSTER_NAME, "user": user, "namespace": "default"},
            }
        ],
        "current-context": f"{user}@{CLUSTER_NAME}",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)

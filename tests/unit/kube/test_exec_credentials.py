"""A kubeconfig's exec credential plugin: its section checked naming each field, the plugin run
with its args, env and KUBERNETES_EXEC_INFO, its ExecCredential read, and every failure
naming the command, the exit code or the field."""

from __future__ import annotations

import base64
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pdserve.kube.exec_credentials import (
    ExecCredentialError,
    ExecPlugin,
    cluster_info,
    parse_exec_config,
)
from tests.support.exec_plugin import V1, V1BETA1, ScriptedPlugin, credential

WHERE = "kubeconfig user 'eks': exec"


def plugin(scripted: ScriptedPlugin, **section: Any) -> ExecPlugin:
    return ExecPlugin(parse_exec_config(scripted.exec_section(**section), WHERE))


@pytest.fixture
def scripted(tmp_path: Path) -> ScriptedPlugin:
    return ScriptedPlugin(tmp_path / "plugin")


# ---- the kubeconfig section ------------------------------------------------------------------


def test_v1_needs_interactive_mode_like_client_go() -> None:
    section = {"apiVersion": V1, "command": "aws", "args": ["eks", "get-token"]}
    with pytest.raises(ExecCredentialError, match=r"exec\.interactiveMode is required"):
        parse_exec_config(section, WHERE)


def test_v1beta1_defaults_to_if_available_and_takes_null_args_and_env() -> None:
    # What `aws eks update-kubeconfig` writes.
    section = {"apiVersion": V1BETA1, "command": "aws", "args": None, "env": None}
    config = parse_exec_config(section, WHERE)
    assert config.command == "aws"
    assert ExecPlugin(config).argv() == ["aws"]


def test_interactive_mode_always_is_refused_naming_the_field_and_the_fix() -> None:
    section = {"apiVersion": V1, "command": "kubelogin", "interactiveMode": "Always"}
    with pytest.raises(ExecCredentialError) as raised:
        parse_exec_config(section, WHERE)
    message = str(raised.value)
    assert f"{WHERE}.interactiveMode: Always needs a terminal" in message
    assert "set it to Never or IfAvailable" in message


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"apiVersion": "client.authentication.k8s.io/v1alpha1", "command": "x"}, "apiVersion"),
        ({"apiVersion": V1, "interactiveMode": "Never"}, "command"),
        ({"apiVersion": V1, "command": "", "interactiveMode": "Never"}, "command"),
        ({"apiVersion": V1, "command": "x", "interactiveMode": "Sometimes"}, "interactiveMode"),
        ({"apiVersion": V1, "command": "x", "interactiveMode": "Never", "env": [{"name": "A"}]},
         "env.0.value"),
        ({"command": "x"}, "apiVersion"),
    ],
)  # fmt: skip
def test_a_bad_section_names_the_field(section: dict[str, Any], named: str) -> None:
    with pytest.raises(ExecCredentialError, match=rf"{WHERE}\.{named}\b"):
        parse_exec_config(section, WHERE)


def test_cluster_info_carries_the_ca_as_data_and_the_exec_extension(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    cluster = {
        "server": "https://eks.example:443", "certificate-authority": "ca.crt",
        "tls-server-name": "kubernetes", "insecure-skip-tls-verify": False,
        "extensions": [{"name": "client.authentication.k8s.io/exec",
                        "extension": {"audience": "pdserve"}}],
    }  # fmt: skip
    assert cluster_info(cluster, str(tmp_path)) == {
        "server": "https://eks.example:443",
        "tls-server-name": "kubernetes",
        "insecure-skip-tls-verify": False,
        "certificate-authority-data": base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode(),
        "config": {"audience": "pdserve"},
    }


# ---- running the plugin ----------------------------------------------------------------------


def test_the_token_and_its_expiry(scripted: ScriptedPlugin) -> None:
    expires = datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)
    scripted.answer(credential("tok-1", expires))
    env = [{"name": "AWS_PROFILE", "value": "prod"}]
    issued = plugin(scripted, env=env).run()
    assert (issued.token, issued.expires) == ("tok-1", expires)
    assert scripted.runs == 1
    assert scripted.env(0)["AWS_PROFILE"] == "prod"
    assert "PATH" in scripted.env(0)  # the process's own environment, added to
    # Never a terminal; no cluster unless provideClusterInfo.
    assert scripted.exec_info(0) == {
        "apiVersion": V1,
        "kind": "ExecCredential",
        "spec": {"interactive": False},
    }


def test_no_expiry_and_v1beta1(scripted: ScriptedPlugin) -> None:
    scripted.answer(credential("tok", api_version=V1BETA1))
    section = scripted.exec_section(V1BETA1)
    del section["interactiveMode"]
    issued = ExecPlugin(parse_exec_config(section, WHERE)).run()
    assert (issued.token, issued.expires) == ("tok", None)


def test_provide_cluster_info_hands_the_cluster_over(scripted: ScriptedPlugin) -> None:
    scripted.answer(credential("tok"))
    config = parse_exec_config(scripted.exec_section(provideClusterInfo=True), WHERE)
    cluster = {"server": "https://eks.example", "certificate-authority-data": "Q0E="}
    ExecPlugin(config, cluster=cluster).run()
    assert scripted.exec_info(0)["spec"] == {"interactive": False, "cluster": cluster}


def test_a_failing_plugin_names_its_command_exit_code_and_stderr_tail(
    scripted: ScriptedPlugin,
) -> None:
    noise = "x" * 5000
    scripted.plan({"stdout": "", "stderr": f"{noise}\nAn error occurred (ExpiredToken)", "exit": 3})
    with pytest.raises(ExecCredentialError) as raised:
        plugin(scripted).run()
    message = str(raised.value)
    assert f"exec plugin `{sys.executable} {scripted.script}` exited with 3: ..." in message
    assert message.endswith("An error occurred (ExpiredToken)")
    assert len(message) < 1200


def printed(**fields: Any) -> str:
    return json.dumps({"apiVersion": V1, "kind": "ExecCredential", **fields})


@pytest.mark.parametrize(
    ("stdout", "named"),
    [
        ("not json", "no valid ExecCredential: Invalid JSON"),
        (json.dumps({"apiVersion": V1, "status": {"token": "t"}}), "kind: Field required"),
        (printed(status={"token": "t", "expirationTimestamp": "tomorrow"}),
         "status.expirationTimestamp: "),
        (printed(status={"token": "t", "expirationTimestamp": "2031-01-02T03:04:05"}),
         "status.expirationTimestamp: Input should have timezone info"),
        (printed(apiVersion=V1BETA1, status={"token": "t"}),
         "apiVersion 'client.authentication.k8s.io/v1beta1', but the kubeconfig's"),
        (printed(), "without `status`"),
        (printed(status={"token": ""}), "no status.token"),
    ],
)  # fmt: skip
def test_a_bad_exec_credential_names_the_field(
    scripted: ScriptedPlugin, stdout: str, named: str
) -> None:
    scripted.plan({"stdout": stdout})
    with pytest.raises(ExecCredentialError, match="printed") as raised:
        plugin(scripted).run()
    assert named in str(raised.value)


def test_client_certificates_are_refused_naming_them(scripted: ScriptedPlugin) -> None:
    scripted.answer(credential(None, clientCertificateData="PEM", clientKeyData="KEY"))
    with pytest.raises(ExecCredentialError) as raised:
        plugin(scripted).run()
    assert "status.clientCertificateData/clientKeyData and no status.token" in str(raised.value)
    assert "pdserve takes only tokens from exec plugins" in str(raised.value)


def test_a_token_beside_a_certificate_is_taken(scripted: ScriptedPlugin) -> None:
    scripted.answer(credential("tok", clientCertificateData="PEM", clientKeyData="KEY"))
    assert plugin(scripted).run().token == "tok"


def test_a_plugin_that_hangs_is_stopped_at_the_timeout() -> None:
    config = parse_exec_config(
        {"apiVersion": V1, "command": sys.executable, "interactiveMode": "Never",
         "args": ["-c", "import sys, time; print('asking', file=sys.stderr, flush=True); "
                        "time.sleep(30)"]},
        WHERE,
    )  # fmt: skip
    with pytest.raises(ExecCredentialError, match=r"did not finish within 0\.5 s: asking"):
        ExecPlugin(config, timeout=0.5).run()


def test_a_missing_command_gives_the_install_hint() -> None:
    hint = "install it with `apt-get install pdserve-no-such-plugin`"
    section = {"apiVersion": V1, "command": "pdserve-no-such-plugin", "interactiveMode": "Never",
               "installHint": hint}  # fmt: skip
    with pytest.raises(ExecCredentialError) as raised:
        ExecPlugin(parse_exec_config(section, WHERE)).run()
    message = str(raised.value)
    assert message.startswith("exec plugin `pdserve-no-such-plugin` could not run: ")
    assert message.endswith("(install it with `apt-get install pdserve-no-such-plugin`)")


def test_a_relative_command_is_relative_to_the_kubeconfig(
    tmp_path: Path, scripted: ScriptedPlugin
) -> None:
    scripted.answer(credential("from-bin"))
    (tmp_path / "bin").mkdir()
    wrapper = tmp_path / "bin" / "get-token"
    wrapper.write_text(
        f"#!{sys.executable}\nimport runpy\nrunpy.run_path({str(scripted.script)!r})\n"
    )
    wrapper.chmod(0o755)
    section = {"apiVersion": V1, "command": "bin/get-token", "interactiveMode": "Never"}
    running = ExecPlugin(parse_exec_config(section, WHERE), base_dir=str(tmp_path))
    assert running.argv() == [str(wrapper)]
    assert running.run().token == "from-bin"

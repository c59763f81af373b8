"""The gateway's keys without sockets: loading them (fail closed), checking a request's, and
the client ids it keeps."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from multidict import CIMultiDict

from pdserve.gateway.errors import GatewayError
from pdserve.gateway.exchange import client_request_id
from pdserve.gateway.intake import Intake
from pdserve.gateway.main import KeyConfigError, api_keys, peer_keys
from pdserve.gateway.settings import GatewaySettings


def intake(**settings: tuple[str, ...]) -> Intake:
    return Intake("m", GatewaySettings(**settings))  # type: ignore[arg-type]


def request(authorization: str | None = None, request_id: str | None = None) -> object:
    """What the checks read of a request: its headers, as aiohttp decodes them (bytes that are
    not UTF-8 as surrogate escapes)."""
    headers: CIMultiDict[str] = CIMultiDict()
    if authorization is not None:
        headers["Authorization"] = authorization
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return SimpleNamespace(headers=headers)


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", "Basic key", "key", "Bearer wrong", "Bearer keyx"],
)
def test_a_request_without_a_valid_key_is_unauthorized(authorization: str | None) -> None:
    with pytest.raises(GatewayError) as refused:
        intake(api_keys=("key",)).authorize(request(authorization))  # type: ignore[arg-type]
    assert refused.value.status == 401
    assert refused.value.kind == "AuthenticationError"


def test_a_header_that_is_not_utf8_is_unauthorized_not_a_crash() -> None:
    # aiohttp hands undecodable header bytes over as surrogate escapes.
    garbled = b"Bearer \xff\xfekey".decode("utf-8", "surrogateescape")
    with pytest.raises(GatewayError) as refused:
        intake(api_keys=("key",)).authorize(request(garbled))  # type: ignore[arg-type]
    assert refused.value.status == 401


def test_any_key_matches_and_the_scheme_is_case_insensitive() -> None:
    gate = intake(api_keys=("one", "two"), peer_keys=("peer",))
    for header in ("Bearer one", "bearer two", "BEARER  two "):
        gate.authorize(request(header))  # type: ignore[arg-type]
    gate.authorize(request("Bearer peer"), peer=True)  # type: ignore[arg-type]
    with pytest.raises(GatewayError):
        gate.authorize(request("Bearer peer"))  # type: ignore[arg-type]


def test_without_api_keys_everyone_passes_but_a_hold_needs_the_peer_key() -> None:
    intake().authorize(request())  # type: ignore[arg-type]
    intake().authorize(request(), peer=True)  # type: ignore[arg-type]
    with pytest.raises(GatewayError, match="--peer-key-file"):
        intake().authorize(request("Bearer x"), peer=True, hold=True)  # type: ignore[arg-type]
    peer_only = intake(peer_keys=("peer",))
    peer_only.authorize(request())  # type: ignore[arg-type]
    peer_only.authorize(request(), peer=True)  # type: ignore[arg-type]
    with pytest.raises(GatewayError):
        peer_only.authorize(request(), peer=True, hold=True)  # type: ignore[arg-type]
    peer_only.authorize(request("Bearer peer"), peer=True, hold=True)  # type: ignore[arg-type]


# ---- loading keys (main.py) --------------------------------------------------------------------
@pytest.mark.parametrize("content", ["", "\n", "   \n\t\n"])
def test_an_empty_key_file_is_a_start_up_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "keys"
    path.write_text(content)
    with pytest.raises(KeyConfigError, match=r"--api-key-file .*holds no key"):
        api_keys(path)
    with pytest.raises(KeyConfigError, match=r"--peer-key-file .*holds no key"):
        peer_keys(path)


@pytest.mark.parametrize("value", ["", " ", "\t\n"])
def test_an_empty_key_variable_is_a_start_up_error(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", value)
    monkeypatch.setenv("PDSERVE_PEER_KEY", value)
    with pytest.raises(KeyConfigError, match="PDSERVE_API_KEY is set but empty"):
        api_keys(None)
    with pytest.raises(KeyConfigError, match="PDSERVE_PEER_KEY is set but empty"):
        peer_keys(None)


def test_keys_come_from_the_file_else_the_variable_else_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert api_keys(None) == ()
    monkeypatch.setenv("PDSERVE_API_KEY", " env-key\n")
    assert api_keys(None) == ("env-key",)
    path = tmp_path / "keys"
    path.write_text("one\n\n  two  \n")
    assert api_keys(path) == ("one", "two")
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(KeyConfigError, match=r"--api-key-file .*not UTF-8"):
        api_keys(path)
    with pytest.raises(KeyConfigError, match=r"--api-key-file .*missing"):
        api_keys(tmp_path / "missing")


# ---- client ids ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("header", "kept"),
    [
        ("req-42", "req-42"),
        (None, None),
        ("", None),
        ("x" * 257, None),
        ("tab\there", None),
        ("caf\u00e9", None),
        (b"\xff".decode("utf-8", "surrogateescape"), None),
    ],
)
def test_only_a_printable_ascii_client_id_is_kept(header: str | None, kept: str | None) -> None:
    assert client_request_id(request(request_id=header)) == kept  # type: ignore[arg-type]

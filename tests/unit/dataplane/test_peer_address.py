"""Behind its data plane every connection reaches the gateway from loopback: the peer gateways'
admission holds are still counted per peer, by the address the data plane forwarded, and a
client cannot pose as another peer by sending its own X-Forwarded-For."""

from __future__ import annotations

from unittest import mock

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from pdserve.gateway.admission import AdmissionHandlers
from pdserve.gateway.fairqueue import PrefillAdmission
from pdserve.gateway.peers import PeerAdmission


def handlers(*, behind_data_plane: bool) -> AdmissionHandlers:
    admission = PrefillAdmission()
    peers = PeerAdmission(admission, lambda: None)  # type: ignore[arg-type,return-value]
    made = AdmissionHandlers(admission, peers, hold_seconds=1)
    made.behind_data_plane = behind_data_plane
    return made


def request(remote: str, forwarded: str | None) -> web.Request:
    headers = {"X-Forwarded-For": forwarded} if forwarded else {}
    transport = mock.Mock()
    transport.get_extra_info.return_value = (remote, 40000)
    return make_mocked_request("POST", "/admission/hold", headers=headers, transport=transport)


def test_peers_are_told_apart_by_the_address_the_data_plane_forwarded() -> None:
    behind = handlers(behind_data_plane=True)
    # The data plane appends the connection's address to whatever the client sent.
    assert behind.peer_address(request("127.0.0.1", "10.0.0.9, 10.0.0.7")) == "10.0.0.7"
    assert behind.peer_address(request("127.0.0.1", None)) == "127.0.0.1"
    direct = handlers(behind_data_plane=False)
    assert direct.peer_address(request("10.0.0.5", "10.0.0.7")) == "10.0.0.5"

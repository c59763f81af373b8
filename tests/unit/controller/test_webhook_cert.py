"""The webhook's certificate, kept by the operator: made once per Secret (two replicas racing
agree on the winner's), served over real TLS to a client that trusts only its CA and checks the
Service's name, and made again only when it no longer names the Service."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from pathlib import Path
from typing import cast

from cryptography import x509

from pdserve.controller.webhook_cert import (
    WebhookCertificate,
    ensure_certificate,
    make_certificate,
    secret_of,
    stored_certificate,
    write_files,
)
from pdserve.kube.client import Kube
from tests.support.fakekube import FakeKube

NAMES = ["pdserve-webhook.pdserve-system.svc"]
NOW = datetime.datetime(2026, 12, 5, tzinfo=datetime.UTC)
NS, SECRET = "pdserve-system", "pdserve-webhook-tls"


async def ensured(kube: FakeKube) -> WebhookCertificate:
    return await ensure_certificate(cast(Kube, kube), NS, SECRET, NAMES)


async def test_a_client_that_trusts_the_ca_reaches_the_webhook_by_its_service_name(
    tmp_path: Path,
) -> None:
    made = make_certificate(NAMES, NOW)
    cert = x509.load_pem_x509_certificate(made.cert)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(made.ca))
    assert made.covers(NAMES)
    assert not made.covers(["other.pdserve-system.svc"])
    cert_file, key_file = write_files(made, tmp_path / "webhook")
    assert key_file.stat().st_mode & 0o077 == 0  # the key: this user's alone

    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert_file, key_file)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=server_side)
    port = server.sockets[0].getsockname()[1]
    client_side = ssl.create_default_context(cadata=made.ca.decode())
    async with server:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_side, server_hostname=NAMES[0]
        )
        assert await reader.read() == b"ok"
        writer.close()


async def test_the_certificate_is_made_once_and_read_back_after() -> None:
    kube = FakeKube()
    first = await ensured(kube)
    assert kube.writes == ["create Secret/pdserve-webhook-tls"]
    again = await ensured(kube)
    assert again == first
    assert kube.writes == ["create Secret/pdserve-webhook-tls"]


async def test_two_replicas_racing_serve_the_winners_certificate() -> None:
    kube = FakeKube()
    theirs = make_certificate(NAMES, NOW)

    def racing_replica() -> None:
        kube.put(secret_of(NS, SECRET, theirs))

    kube.before_create = racing_replica
    ours = await ensured(kube)
    assert ours == theirs


async def test_a_certificate_that_no_longer_names_the_service_is_made_again() -> None:
    kube = FakeKube()
    old = make_certificate(["old-webhook.pdserve-system.svc"], NOW)
    stored = secret_of(NS, SECRET, old)
    stored["metadata"]["resourceVersion"] = "7"
    kube.put(stored)
    new = await ensured(kube)
    assert new.covers(NAMES)
    assert kube.writes == ["replace Secret/pdserve-webhook-tls"]
    assert (
        stored_certificate(kube.objects[("Secret", "pdserve-system", "pdserve-webhook-tls")]) == new
    )

"""The admission webhook's serving certificate, kept by the operator itself instead of the chart:
a chart that minted a CA per render (`genCA`) changed on every `helm template` (Argo CD, Flux),
rolling the operator and swapping the CA under a running webhook on every sync.

At start-up each replica takes the certificate from one Secret in its own namespace, making it
when there is none (two replicas may race: the loser's create answers 409 and it reads the
winner's), writes it where the webhook server reads it, and puts the CA into the webhook
configuration's caBundle by server-side apply, owning that one field: the chart renders the
configuration without it, so neither `helm upgrade` nor a GitOps sync ever sees it differ."""

from __future__ import annotations

import base64
import datetime
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.controller.settings import WebhookSettings
from pdserve.kube.client import KINDS, Kube, written_or_theirs

log = logging.getLogger("pdserve.webhook")

SECRET = KINDS[("v1", "Secret")]
WEBHOOK_CONFIGURATION = KINDS[("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration")]
FIELD_MANAGER = "pdserve-webhook-ca"
VALID_DAYS = 3650
"""As long as the chart's certificate was: a certificate the operator made is never rotated
under a running webhook; delete its Secret and restart the operator for a new one."""


@dataclass(frozen=True)
class WebhookCertificate:
    ca: bytes
    cert: bytes
    key: bytes
    """PEM, each."""

    def covers(self, names: Sequence[str]) -> bool:
        """The serving certificate names every one of `names` (the Service's DNS names)."""
        try:
            sans = x509.load_pem_x509_certificate(self.cert).extensions.get_extension_for_class(
                x509.SubjectAlternativeName
            )
        except (ValueError, x509.ExtensionNotFound):
            return False
        return set(names) <= set(sans.value.get_values_for_type(x509.DNSName))


def make_certificate(names: Sequence[str], now: datetime.datetime) -> WebhookCertificate:
    """A CA of its own and a serving certificate it signs for `names` (the first is the
    subject): the API server trusts the CA through the webhook configuration's caBundle."""
    until = now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{names[0]} webhook CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    return WebhookCertificate(
        ca=ca.public_bytes(pem),
        cert=cert.public_bytes(pem),
        key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=not cert_sign,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
        crl_sign=cert_sign, encipher_only=False, decipher_only=False,
    )  # fmt: skip


def secret_of(namespace: str, name: str, certificate: WebhookCertificate) -> dict[str, Any]:
    encoded = {"ca.crt": certificate.ca, "tls.crt": certificate.cert, "tls.key": certificate.key}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "pdserve"}},
        "type": "kubernetes.io/tls",
        "data": {k: base64.b64encode(v).decode() for k, v in encoded.items()},
    }  # fmt: skip


def stored_certificate(secret: Mapping[str, Any]) -> WebhookCertificate | None:
    data = secret.get("data") or {}
    try:
        ca, cert, key = (base64.b64decode(data[k]) for k in ("ca.crt", "tls.crt", "tls.key"))
    except (KeyError, TypeError, ValueError):
        return None
    return WebhookCertificate(ca, cert, key)


async def ensure_certificate(
    kube: Kube, namespace: str, name: str, names: Sequence[str]
) -> WebhookCertificate:
    """The certificate in Secret `namespace`/`name`, made when there is none, and made again
    when the stored one does not name the Service (renamed with the release)."""
    found = await kube.get(SECRET, namespace, name)
    stored = stored_certificate(found) if found is not None else None
    if stored is not None and stored.covers(names):
        return stored
    made = secret_of(namespace, name, make_certificate(names, datetime.datetime.now(datetime.UTC)))

    async def write() -> None:
        if found is None:
            await kube.create(made)
        else:
            made["metadata"]["resourceVersion"] = found["metadata"]["resourceVersion"]
            await kube.replace(made)
        log.info("made the webhook's certificate for %s in Secret %s/%s", ", ".join(names),
                 namespace, name)  # fmt: skip

    found = await written_or_theirs(kube, write, SECRET, namespace, name)
    stored = stored_certificate(found) if found is not None else None
    if stored is None:
        raise RuntimeError(
            f"Secret {namespace}/{name} holds no webhook certificate (ca.crt, tls.crt, "
            "tls.key): delete it and restart the operator to make a new one"
        )
    return stored


def write_files(certificate: WebhookCertificate, directory: Path) -> tuple[Path, Path]:
    """tls.crt and tls.key for the webhook server (the key readable by this user only)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "tls.crt", directory / "tls.key"
    cert.write_bytes(certificate.cert)
    key.touch(mode=0o600)
    key.write_bytes(certificate.key)
    return cert, key


async def serve_own_certificate(kube: Kube, namespace: str, hook: WebhookSettings) -> None:
    """Before the webhook server starts: its certificate from hook.cert_secret (made when
    missing) in the files it reads, and the CA in hook.configuration's caBundle."""
    assert hook.cert_secret is not None
    certificate = await ensure_certificate(kube, namespace, hook.cert_secret, hook.service_names)
    cert, key = write_files(certificate, Path(hook.cert_file).parent)
    assert (str(cert), str(key)) == (hook.cert_file, hook.key_file)
    if hook.configuration is not None:
        await inject_ca(kube, hook.configuration, certificate)


async def inject_ca(kube: Kube, configuration: str, certificate: WebhookCertificate) -> None:
    """caBundle of every webhook of the configuration: this CA (server-side apply of that one
    field; the chart owns the rest of the configuration)."""
    found = await kube.get(WEBHOOK_CONFIGURATION, None, configuration)
    if found is None:
        raise RuntimeError(
            f"ValidatingWebhookConfiguration {configuration} (--webhook-configuration) does not "
            "exist: install the chart, which makes it"
        )
    webhooks = [w["name"] for w in found.get("webhooks") or []]
    bundle = base64.b64encode(certificate.ca).decode()
    if all((w.get("clientConfig") or {}).get("caBundle") == bundle
           for w in found.get("webhooks") or []):  # fmt: skip
        return
    log.info("putting the webhook's CA into %s", configuration)
    await kube.apply(
        {
            "apiVersion": WEBHOOK_CONFIGURATION.api_version,
            "kind": WEBHOOK_CONFIGURATION.kind,
            "metadata": {"name": configuration},
            "webhooks": [{"name": w, "clientConfig": {"caBundle": bundle}} for w in webhooks],
        },
        field_manager=FIELD_MANAGER,
    )

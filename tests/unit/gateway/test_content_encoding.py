"""The gateway undoes a request body's Content-Encoding itself (aiohttp's parser would answer
what it cannot decode in text/plain): gzip, deflate (with or without its zlib header) and
identity, in the order listed; anything else is a 415, a body that does not decode a 400, and
one that decodes past the size cap a 413 without being decoded further."""

from __future__ import annotations

import gzip
import zlib

import pytest

from pdserve.gateway.content_encoding import decoded
from pdserve.gateway.errors import GatewayError

BODY = b'{"messages": [{"role": "user", "content": "hello"}]}'
LIMIT = 1024


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


@pytest.mark.parametrize(
    ("sent", "encoding"),
    [
        (BODY, ""),
        (BODY, "identity"),
        (gzip.compress(BODY), "gzip"),
        (gzip.compress(BODY), "X-GZIP"),
        (gzip.compress(BODY[:10]) + gzip.compress(BODY[10:]), "gzip"),  # two gzip members
        (zlib.compress(BODY), "deflate"),
        (raw_deflate(BODY), "deflate"),
        (gzip.compress(zlib.compress(BODY)), "deflate, gzip"),  # the last one applied first
        (gzip.compress(BODY), "identity, gzip"),
    ],
)
def test_what_the_gateway_decodes(sent: bytes, encoding: str) -> None:
    assert decoded(sent, encoding, LIMIT) == BODY


def test_an_empty_body_needs_no_decoding() -> None:
    assert decoded(b"", "gzip", LIMIT) == b""


def refusal(sent: bytes, encoding: str, limit: int = LIMIT) -> GatewayError:
    with pytest.raises(GatewayError) as raised:
        decoded(sent, encoding, limit)
    return raised.value


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, br", "x"])
def test_a_coding_the_gateway_does_not_decode_is_a_415_naming_it(encoding: str) -> None:
    error = refusal(BODY, encoding)
    coding = encoding.split(", ")[-1]
    assert (error.status, error.kind) == (415, "UnsupportedMediaType")
    assert error.message == (
        f"Content-Encoding: {coding} is not supported; send the body as gzip, deflate or "
        "identity (uncompressed)"
    )


@pytest.mark.parametrize(
    ("sent", "encoding", "why"),
    [
        (gzip.compress(BODY)[:-12], "gzip", "it is cut short"),
        (zlib.compress(BODY)[:6], "deflate", "it is cut short"),
        (b"not gzip", "gzip", "incorrect header check"),
        (zlib.compress(BODY) + b"more", "deflate", "there is data after its end"),
        (gzip.compress(BODY) + b"more", "gzip", "incorrect header check"),
    ],
)
def test_a_body_that_does_not_decode_as_its_header_says_is_a_400(
    sent: bytes, encoding: str, why: str
) -> None:
    error = refusal(sent, encoding)
    assert error.status == 400
    assert error.message.startswith(
        f"request body does not decode as its Content-Encoding: {encoding} says ("
    )
    assert why in error.message
    assert error.message.endswith(
        f"send the whole body {encoding}-compressed, or uncompressed without the header"
    )


def test_a_body_that_decodes_past_the_cap_is_a_413_and_decoded_no_further() -> None:
    bomb = gzip.compress(b"0" * 8 * 1024**2)  # 8 KiB that would be 8 MiB
    error = refusal(bomb, "gzip", limit=LIMIT)
    assert (error.status, error.kind) == (413, "RequestTooLarge")
    assert (
        error.message == f"request body exceeds {LIMIT} bytes once decoded (Content-Encoding: gzip)"
    )


def test_a_body_of_exactly_the_cap_is_read() -> None:
    assert decoded(gzip.compress(b"0" * LIMIT), "gzip", LIMIT) == b"0" * LIMIT

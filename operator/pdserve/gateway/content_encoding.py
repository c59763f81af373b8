"""A request body's Content-Encoding, undone by the gateway rather than by aiohttp's HTTP parser
(Gateway.app turns that off). The parser answers a coding it has no library for (br, zstd) and
a deflate body that does not decode itself, in text/plain, before any route sees the request,
and passes a gzip body cut short, or a coding it does not know, on as if it were the body. Here
each is an OpenAI-shaped error naming the header and the codings the gateway reads, whatever
compression libraries are installed and however the body's bytes arrived."""

from __future__ import annotations

import zlib

from pdserve.gateway.errors import GatewayError

# What the gateway decodes, besides identity (x-gzip: gzip's old name, RFC 9110 8.4.1.3).
_GZIP = 16 + zlib.MAX_WBITS
_WBITS = {"gzip": _GZIP, "x-gzip": _GZIP, "deflate": zlib.MAX_WBITS}


def decoded(body: bytes, content_encoding: str, limit: int) -> bytes:
    """`body` with the codings `content_encoding` lists undone (the last one applied first), at
    most `limit` bytes of it: 415 for a coding the gateway does not decode, 400 for a body that
    does not decode as its header says, 413 once it decodes to more than `limit` bytes."""
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in codings:
        if coding not in _WBITS and coding != "identity":
            raise GatewayError(
                415,
                f"Content-Encoding: {coding[:50]} is not supported; send the body as gzip, "
                "deflate or identity (uncompressed)",
            )
    for coding in reversed(codings):
        if coding != "identity" and body:
            body = _inflate(body, coding, limit)
    return body


def _inflate(body: bytes, coding: str, limit: int) -> bytes:
    wbits = _WBITS[coding]
    if coding == "deflate" and body[0] & 0x0F != 8:
        # No zlib header (RFC 1950): raw deflate, which some clients send as `deflate` (aiohttp
        # reads it too).
        wbits = -zlib.MAX_WBITS
    out = bytearray()
    rest = body
    try:
        while rest:  # a gzip body may be several members, one after another (RFC 1952)
            stream = zlib.decompressobj(wbits)
            # Never more than one byte past the limit, however far the body would expand.
            out += stream.decompress(rest, limit + 1 - len(out))
            if len(out) > limit:
                raise GatewayError(
                    413,
                    f"request body exceeds {limit} bytes once decoded (Content-Encoding: {coding})",
                )
            if not stream.eof:
                raise _undecodable(coding, "it is cut short")
            rest = stream.unused_data
            if rest and wbits != _GZIP:
                raise _undecodable(coding, "there is data after its end")
    except zlib.error as error:
        raise _undecodable(coding, str(error)) from None
    return bytes(out)


def _undecodable(coding: str, why: str) -> GatewayError:
    return GatewayError(
        400,
        f"request body does not decode as its Content-Encoding: {coding} says ({why}); send "
        f"the whole body {coding}-compressed, or uncompressed without the header",
    )

"""The pure side of the connection: h11 events to a Request, response headers, refusals.

No I/O here: values in, values out (tested without sockets).
"""

from __future__ import annotations

import zlib
from urllib.parse import parse_qsl, unquote

import h11

from . import limits
from .errors import HTTPError
from .types import Request

Address = tuple[str, int]

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "font-src 'self'; connect-src 'self'; media-src 'none'; object-src 'none'; "
    "frame-src 'self' blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = [
    ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
]
# Framing is the connection's business, never a handler's.
_FRAMING_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive",
                    "upgrade", "content-type"}
# Refusals after which the connection is closed rather than reused.
CLOSING_STATUSES = {400, 408, 413, 431}


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, "bad_request", message)


def too_large(limit: int) -> HTTPError:
    return HTTPError(413, "too_large", f"The request body is over this route's limit of {limit} bytes.")


# Request bodies sent compressed (as llama-server and its clients may): the route's body
# cap holds for the bytes sent and again for the bytes they decode to.
BODY_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
                "deflate": zlib.MAX_WBITS}


def body_coding(request: Request) -> str | None:
    """The body's Content-Encoding (None for none or identity); 415 for a coding this
    server does not read, or for two or more."""
    values = [v for k, v in request.headers if k == "content-encoding"]
    codings = [c.strip().lower() for v in values for c in v.split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in BODY_CODINGS:
        raise HTTPError(415, "unsupported_encoding", "Send the request body as it is, or "
                        "compressed once with gzip or deflate.",
                        headers=[("Accept-Encoding", "gzip, deflate")])
    return codings[0]


def decode_body(body: bytes, coding: str, limit: int) -> bytes:
    """`body` decoded from `coding`, at most `limit` bytes (413 past it, 400 when it does
    not decode or carries bytes past its stream). An empty body is read as sent."""
    if not body:
        return body
    d = zlib.decompressobj(BODY_CODINGS[coding])
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error:
        raise bad_request(f"The request body does not decode as {coding}.") from None
    if len(out) > limit or d.unconsumed_tail:
        raise too_large(limit)
    if not d.eof:
        raise bad_request(f"The request body's {coding} stream is cut short.")
    if d.unused_data:
        raise bad_request(f"The request body carries bytes past its {coding} stream.")
    return out


def timed_out() -> HTTPError:
    return HTTPError(408, "timeout", "The request did not arrive in time.")


def malformed(exc: h11.RemoteProtocolError) -> HTTPError:
    status = exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400
    code = "headers_too_large" if status == 431 else "bad_request"
    return HTTPError(status, code, f"The request is not valid HTTP/1.1: {str(exc)[:200]}")


def too_long(content_length: str | None, limit: int) -> bool:
    """A Content-Length (h11 checked it is digits) over ``limit``."""
    return content_length is not None and (len(content_length) > 18 or int(content_length) > limit)


def head_size(event: h11.Request) -> int:
    """About the bytes of the head as sent: h11 bounds only a head still incomplete,
    so a large head that arrives whole is measured here."""
    return len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers) + 16


def build_request(event: h11.Request, peer: Address, local: Address) -> Request:
    """The Request for an h11 head (body still empty); HTTPError 400 if unusable."""
    if event.http_version not in (b"1.0", b"1.1"):
        raise bad_request("Only HTTP/1.0 and HTTP/1.1 are spoken here.")
    names = {name for name, _ in event.headers}
    if b"transfer-encoding" in names and b"content-length" in names:
        raise bad_request("Content-Length and Transfer-Encoding together are refused.")
    try:
        target = event.target.decode("ascii")
        raw_path, _, raw_query = target.partition("?")
        path = unquote(raw_path, errors="strict")
        query = dict(parse_qsl(raw_query, keep_blank_values=True, errors="strict",
                               max_num_fields=limits.MAX_QUERY_FIELDS))
    except ValueError:
        raise bad_request("The request target is not valid (percent-encoded UTF-8 expected).") from None
    if not raw_path.startswith("/"):
        raise bad_request("The request target must be a path.")
    headers = [(n.decode("ascii"), v.decode("latin-1")) for n, v in event.headers]
    if head_size(event) > limits.MAX_HEADER_BYTES:
        raise HTTPError(431, "headers_too_large", "The request head is too large.")
    return Request(method=event.method.decode("ascii"), target=target, path=path, query=query,
                   headers=headers, body=b"", peer=peer, local=local)


def response_headers(
    status: int, content_type: str, extra: list[tuple[str, str]], *, length: int | None, close: bool
) -> list[tuple[bytes, bytes]]:
    """Security headers (a handler may replace one by naming it), type, length, extras."""
    named = {k.lower() for k, _ in extra}
    headers = [(k, v) for k, v in SECURITY_HEADERS if k.lower() not in named]
    if content_type and status not in (204, 304):
        headers.append(("Content-Type", content_type))
    headers += [(k, v) for k, v in extra if k.lower() not in _FRAMING_HEADERS]
    if length is not None and status not in (204, 304):
        headers.append(("Content-Length", str(length)))
    if close:
        headers.append(("Connection", "close"))
    return [(k.encode("ascii"), v.encode("latin-1")) for k, v in headers]

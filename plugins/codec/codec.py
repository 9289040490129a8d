"""codec: hashes, HMAC, base64/base32/hex/URL encoding, UUIDs and (unverified) JWT decoding.

Binary data travels as base64 in both directions; text is UTF-8.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import hashlib
import hmac as _hmac
import json
import re
import urllib.parse
import uuid as _uuid
from typing import Annotated, Any, Literal

import msgspec

from sandbox import ToolError, tool

READ_ONLY = {"readOnlyHint": True, "idempotentHint": True, "openWorldHint": False}

MAX_INPUT_BYTES = 8 * 1024 * 1024
MAX_KEY_BYTES = 64 * 1024
MAX_JWT_CHARS = 64 * 1024

Algorithm = Literal["md5", "sha1", "sha224", "sha256", "sha384", "sha512", "blake2b", "blake2s", "sha3_256", "sha3_512"]
InputEncoding = Literal["utf8", "base64", "hex"]
DigestEncoding = Literal["hex", "base64", "base64url"]


def _b64decode(data: str, what: str, urlsafe: bool = False) -> bytes:
    """Strict base64 (standard or URL-safe alphabet); missing padding and whitespace are tolerated."""
    cleaned = re.sub(r"\s+", "", data)
    if urlsafe:
        cleaned = cleaned.replace("-", "+").replace("_", "/")
    cleaned += "=" * (-len(cleaned) % 4)
    try:
        return base64.b64decode(cleaned, validate=True)
    except (binascii.Error, ValueError):
        alphabet = "URL-safe base64" if urlsafe else "base64"
        raise ToolError(f"{what} is not valid {alphabet}") from None


def _to_bytes(data: str, encoding: str, what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    if len(data) > 2 * limit:
        raise ToolError(f"{what} is too large; the limit is {limit:,} bytes")
    if encoding == "utf8":
        raw = data.encode("utf-8", "surrogatepass")
    elif encoding == "base64":
        raw = _b64decode(data, what)
    elif encoding == "hex":
        try:
            raw = bytes.fromhex(re.sub(r"[\s:]", "", data))
        except ValueError:
            raise ToolError(f"{what} is not valid hex") from None
    else:  # pragma: no cover - Literal checked by the daemon
        raise ToolError(f"unknown encoding {encoding!r}")
    if len(raw) > limit:
        raise ToolError(f"{what} is too large; the limit is {limit:,} bytes")
    return raw


def _encode_digest(digest: bytes, encoding: str) -> str:
    if encoding == "hex":
        return digest.hex()
    if encoding == "base64url":
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")
    return base64.b64encode(digest).decode("ascii")


# -- hash and HMAC -----------------------------------------------------------------------------


class HashResult(msgspec.Struct):
    algorithm: str
    digest: str
    encoding: str
    input_bytes: int


@tool(name="hash", annotations={"title": "Hash", **READ_ONLY})
def hash_data(
    data: str,
    algorithm: Algorithm = "sha256",
    input_encoding: InputEncoding = "utf8",
    output: DigestEncoding = "hex",
) -> HashResult:
    """Compute a cryptographic hash (md5, sha1, sha2, blake2 or sha3) of a text or of binary data given as base64 or hex.

    md5 and sha1 are broken for security purposes; use them only for checksums and legacy formats.

    Args:
        data: The text, or the bytes encoded as `input_encoding` says (at most 8 MB).
        algorithm: The hash function.
        input_encoding: How `data` is given: utf8 (hash the UTF-8 bytes of the text), base64 or hex.
        output: How to encode the digest: hex (lowercase), base64 or base64url (unpadded).
    """
    raw = _to_bytes(data, input_encoding, "data")
    digest = hashlib.new(algorithm, raw).digest()
    return HashResult(algorithm, _encode_digest(digest, output), output, len(raw))


class HmacResult(msgspec.Struct):
    algorithm: str
    digest: str
    encoding: str
    #: Whether ``expected`` matched; null when no expected value was given.
    matches: bool | None = None


@tool(annotations={"title": "HMAC", **READ_ONLY})
def hmac(
    key: str,
    message: str,
    algorithm: Algorithm = "sha256",
    key_encoding: InputEncoding = "utf8",
    message_encoding: InputEncoding = "utf8",
    output: DigestEncoding = "hex",
    expected: str | None = None,
) -> HmacResult:
    """Compute an HMAC (keyed hash, RFC 2104) of a message, and optionally check it against an expected value in constant time.

    Args:
        key: The secret key, encoded as `key_encoding` says (at most 64 KB).
        message: The message, encoded as `message_encoding` says (at most 8 MB).
        algorithm: The underlying hash function.
        key_encoding: How `key` is given: utf8, base64 or hex.
        message_encoding: How `message` is given: utf8, base64 or hex.
        output: How to encode the digest: hex (lowercase), base64 or base64url (unpadded).
        expected: A digest to verify against, in the `output` encoding (hex is case-insensitive, base64 padding optional); `matches` then tells the outcome.
    """
    k = _to_bytes(key, key_encoding, "key", MAX_KEY_BYTES)
    m = _to_bytes(message, message_encoding, "message")
    digest = _encode_digest(_hmac.new(k, m, algorithm).digest(), output)
    if expected is None:
        return HmacResult(algorithm, digest, output)
    want = expected.strip()
    want = want.lower() if output == "hex" else want.rstrip("=")
    matches = _hmac.compare_digest(want.encode("utf-8", "replace"), digest.rstrip("=").encode("ascii"))
    return HmacResult(algorithm, digest, output, matches)


# -- encode / decode ---------------------------------------------------------------------------

Scheme = Literal["base64", "base64url", "base32", "hex", "url", "url_form"]


class EncodeResult(msgspec.Struct):
    scheme: str
    result: str
    input_bytes: int


@tool(annotations={"title": "Encode", **READ_ONLY})
def encode(
    data: str,
    scheme: Scheme,
    input_encoding: InputEncoding = "utf8",
    padding: bool = True,
) -> EncodeResult:
    """Encode text or bytes as base64, URL-safe base64, base32, hex or URL percent-encoding.

    url escapes everything but letters, digits and -._~ (for a path segment or query value);
    url_form is application/x-www-form-urlencoded (spaces become +).

    Args:
        data: The text, or the bytes encoded as `input_encoding` says (at most 8 MB).
        scheme: The encoding to produce.
        input_encoding: How `data` is given: utf8 (encode the UTF-8 bytes of the text), base64 or hex.
        padding: Keep the trailing = padding of base64, base64url and base32.
    """
    raw = _to_bytes(data, input_encoding, "data")
    if scheme == "base64":
        out = base64.b64encode(raw).decode("ascii")
    elif scheme == "base64url":
        out = base64.urlsafe_b64encode(raw).decode("ascii")
    elif scheme == "base32":
        out = base64.b32encode(raw).decode("ascii")
    elif scheme == "hex":
        out = raw.hex()
    elif scheme == "url":
        out = urllib.parse.quote_from_bytes(raw, safe="")
    else:
        out = urllib.parse.quote_plus(raw, safe="")
    if not padding and scheme in ("base64", "base64url", "base32"):
        out = out.rstrip("=")
    return EncodeResult(scheme, out, len(raw))


class DecodeResult(msgspec.Struct):
    scheme: str
    result: str
    output_encoding: str
    output_bytes: int


@tool(annotations={"title": "Decode", **READ_ONLY})
def decode(
    data: str,
    scheme: Scheme,
    output: Literal["auto", "utf8", "base64", "hex"] = "auto",
) -> DecodeResult:
    """Decode base64, URL-safe base64, base32, hex or URL percent-encoding back to text or bytes.

    Whitespace and missing padding are tolerated; any other invalid character is an error.

    Args:
        data: The encoded input (at most 16 MB of text).
        scheme: The encoding `data` is in.
        output: How to return the decoded bytes: utf8 text, base64, hex, or auto (UTF-8 text when the bytes are valid UTF-8, else base64).
    """
    if len(data) > 2 * MAX_INPUT_BYTES:
        raise ToolError(f"data is too large; the limit is {2 * MAX_INPUT_BYTES:,} characters")
    if scheme in ("base64", "base64url"):
        raw = _b64decode(data, "data", urlsafe=scheme == "base64url")
    elif scheme == "base32":
        cleaned = re.sub(r"\s+", "", data).upper()
        cleaned += "=" * (-len(cleaned) % 8)
        try:
            raw = base64.b32decode(cleaned)
        except (binascii.Error, ValueError):
            raise ToolError("data is not valid base32") from None
    elif scheme == "hex":
        raw = _to_bytes(data, "hex", "data")
    elif scheme == "url":
        raw = urllib.parse.unquote_to_bytes(data)
    else:
        raw = urllib.parse.unquote_to_bytes(data.replace("+", " "))
    if output in ("auto", "utf8"):
        try:
            return DecodeResult(scheme, raw.decode("utf-8"), "utf8", len(raw))
        except UnicodeDecodeError:
            if output == "utf8":
                raise ToolError("the decoded bytes are not valid UTF-8; ask for output base64 or hex") from None
            output = "base64"
    if output == "hex":
        return DecodeResult(scheme, raw.hex(), "hex", len(raw))
    return DecodeResult(scheme, base64.b64encode(raw).decode("ascii"), "base64", len(raw))


# -- UUID --------------------------------------------------------------------------------------

_NAMESPACES = {
    "dns": _uuid.NAMESPACE_DNS,
    "url": _uuid.NAMESPACE_URL,
    "oid": _uuid.NAMESPACE_OID,
    "x500": _uuid.NAMESPACE_X500,
}


class UuidResult(msgspec.Struct):
    version: int
    uuids: list[str]


@tool(name="uuid", annotations={"title": "Generate UUIDs", "readOnlyHint": True, "openWorldHint": False})
def make_uuid(
    version: Literal[4, 5] = 4,
    count: Annotated[
        int,
        msgspec.Meta(ge=1, le=1000, description="How many v4 UUIDs to generate (1-1000); v5 always gives one."),
    ] = 1,
    name: str | None = None,
    namespace: str = "dns",
) -> UuidResult:
    """Generate UUIDs: random version 4, or deterministic version 5 (SHA-1 of a namespace and a name, RFC 9562).

    The same namespace and name always give the same v5 UUID.

    Args:
        version: 4 for random UUIDs, 5 for name-based ones.
        name: The name to hash; required for version 5 (e.g. "example.com" in the dns namespace).
        namespace: For version 5: dns, url, oid, x500, or any UUID to use as a custom namespace.
    """
    if version == 4:
        if name is not None:
            raise ToolError("name is only used with version 5")
        return UuidResult(4, [str(_uuid.uuid4()) for _ in range(count)])
    if name is None:
        raise ToolError("version 5 needs a name")
    if len(name) > 65536:
        raise ToolError("name is too long (limit 65536 characters)")
    ns = _NAMESPACES.get(namespace.lower())
    if ns is None:
        try:
            ns = _uuid.UUID(namespace)
        except ValueError:
            raise ToolError(f"namespace must be dns, url, oid, x500 or a UUID, not {namespace!r}") from None
    return UuidResult(5, [str(_uuid.uuid5(ns, name))])


# -- JWT ---------------------------------------------------------------------------------------


class JwtResult(msgspec.Struct):
    verified: bool
    warning: str
    header: dict[str, Any]
    payload: Any
    signature: str
    algorithm: str | None
    issued_at: str | None
    not_before: str | None
    expires_at: str | None
    expired: bool | None


_NOT_VERIFIED = (
    "The signature was NOT verified: anyone can forge these claims. Do not trust them for "
    "authentication or authorization."
)


def _b64url_json(part: str, what: str) -> Any:
    raw = _b64decode(part, f"the JWT {what}", urlsafe=True)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ToolError(f"the JWT {what} is not JSON") from None


def _wire_safe(value: Any) -> Any:
    """Integers beyond 64 bits cannot cross the worker channel; turn them into strings."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and not -(2**63) <= value < 2**64:
        return str(value)
    if isinstance(value, dict):
        return {k: _wire_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_wire_safe(v) for v in value]
    return value


def _timestamp(payload: Any, claim: str) -> str | None:
    if not isinstance(payload, dict):
        return None
    value = payload.get(claim)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return _dt.datetime.fromtimestamp(value, _dt.UTC).isoformat().replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return None


@tool(annotations={"title": "Decode JWT (unverified)", **READ_ONLY})
def jwt_decode(token: str) -> JwtResult:
    """Decode a JSON Web Token's header and payload for display WITHOUT verifying its signature.

    The claims are shown as they are written in the token; nothing proves they are genuine, so never
    use this to decide whether to trust a token. Also reports the algorithm and, when present, the
    iat/nbf/exp times in UTC and whether the token has expired by the current clock.

    Args:
        token: The compact JWT (header.payload.signature), optionally prefixed with "Bearer ".
    """
    token = token.strip()
    if token.lower().startswith("bearer "):
        token = token[7:].strip()
    if len(token) > MAX_JWT_CHARS:
        raise ToolError(f"token is too long; the limit is {MAX_JWT_CHARS:,} characters")
    parts = token.split(".")
    if len(parts) == 5:
        raise ToolError("this is an encrypted JWT (JWE, 5 parts); it cannot be decoded without the key")
    if len(parts) != 3:
        raise ToolError(f"a JWT has 3 dot-separated parts (header.payload.signature); this has {len(parts)}")
    header = _b64url_json(parts[0], "header")
    if not isinstance(header, dict):
        raise ToolError("the JWT header is not a JSON object")
    payload = _b64url_json(parts[1], "payload")
    expired = None
    exp = payload.get("exp") if isinstance(payload, dict) else None
    if isinstance(exp, (int, float)) and not isinstance(exp, bool):
        expired = exp <= _dt.datetime.now(_dt.UTC).timestamp()
    alg = header.get("alg")
    return JwtResult(
        verified=False,
        warning=_NOT_VERIFIED if alg != "none" else "This token is unsigned (alg none). " + _NOT_VERIFIED,
        header=_wire_safe(header),
        payload=_wire_safe(payload),
        signature=parts[2],
        algorithm=alg if isinstance(alg, str) else None,
        issued_at=_timestamp(payload, "iat"),
        not_before=_timestamp(payload, "nbf"),
        expires_at=_timestamp(payload, "exp"),
        expired=expired,
    )

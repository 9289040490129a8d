"""Sealed ``requestState`` for 2026-07-28 ``input_required`` results (multi round-trip requests).

A client echoes ``requestState`` verbatim on its retry, but it is attacker-controlled, so what we
put in it is sealed: msgpack, then an HMAC-SHA256 tag under the daemon's secret key, both base64url
(``<payload>.<tag>``). Daemons that share the key (several behind a balancer) read each other's
state. It binds what the retry must match — the principal, the tool, a digest of the arguments —
and an expiry; it carries the answers the client gave in earlier rounds (so a daemon that does not
hold the waiting call can run the tool again from the start and answer its questions from them),
the keys asked in the last round, and where the waiting call is parked (daemon instance and park
id), if anywhere. Tampered, foreign or expired state raises ``StateRejected`` (answered -32602).

The client's own answers are inside, readable by the client that gave them; nothing else is.
Sans-io: stdlib ``hmac`` and msgspec only; the clock is a parameter.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from typing import Any

import msgspec

#: Largest ``requestState`` we issue or accept (it travels in every retry).
MAX_STATE_BYTES = 256 * 1024
_TAG_BYTES = 32


class StateRejected(Exception):
    """A ``requestState`` we did not issue, altered, for another request or expired."""


class RequestState(msgspec.Struct, frozen=True, array_like=True):
    principal: str
    tool: str
    #: ``digest_arguments`` of the call's arguments.
    arguments: str
    expires_ms: int
    #: Every answer the client gave so far, by key (the client's result objects).
    answers: dict[str, Any]
    #: The keys asked in the last round.
    asked: list[str]
    #: Where the call waits for the retry: the daemon instance and its park id ("" for none).
    daemon: str = ""
    park: str = ""
    #: Makes every issued state unique, even for identical content.
    nonce: str = ""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RequestState)
_canonical = msgspec.json.Encoder(order="sorted")


def digest_arguments(arguments: Any) -> str:
    """A stable digest of a call's arguments (key order does not matter)."""
    try:
        data = _canonical.encode(arguments)
    except (TypeError, ValueError, OverflowError):
        data = repr(arguments).encode()
    return hashlib.sha256(data).hexdigest()[:32]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


_B64URL = re.compile(r"[A-Za-z0-9_-]+")


def _unb64(text: str) -> bytes:
    """Strict: only the exact text we would have written decodes (no padding, spaces, spare bits)."""
    if not text or len(text) > MAX_STATE_BYTES or not _B64URL.fullmatch(text):
        raise StateRejected("requestState is malformed")
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError):
        raise StateRejected("requestState is malformed") from None
    if _b64(data) != text:
        raise StateRejected("requestState is malformed")
    return data


class Sealer:
    """Seals and opens ``RequestState`` under one key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the requestState key must be at least 16 bytes")
        self._key = key

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self._key, b"toolcell-request-state-v1\0" + payload, hashlib.sha256).digest()[:_TAG_BYTES]

    def seal(self, state: RequestState) -> str:
        if not state.nonce:
            state = msgspec.structs.replace(state, nonce=secrets.token_hex(8))
        payload = _encoder.encode(state)
        text = _b64(payload) + "." + _b64(self._tag(payload))
        if len(text) > MAX_STATE_BYTES:
            raise StateRejected(f"the answers so far do not fit in a requestState ({MAX_STATE_BYTES} bytes)")
        return text

    def open(self, text: Any, now_ms: int) -> RequestState:
        """The state sealed in ``text``; raises ``StateRejected``."""
        if not isinstance(text, str) or text.count(".") != 1:
            raise StateRejected("requestState was not issued by this server")
        body, tag = text.split(".")
        payload = _unb64(body)
        if not hmac.compare_digest(self._tag(payload), _unb64(tag)):
            raise StateRejected("requestState was not issued by this server or was altered")
        try:
            state = _decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError):
            raise StateRejected("requestState is malformed") from None
        if state.expires_ms < now_ms:
            raise StateRejected("requestState has expired; call the tool again from the start")
        return state

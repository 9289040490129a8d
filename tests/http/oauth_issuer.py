"""A real OAuth authorization server for the resource-server tests, built from well-kept libraries:
joserfc (Authlib's JOSE library) keeps the keys, publishes the JWKS and mints the tokens; the issuer
speaks HTTPS (Python's own ``http.server`` + ``ssl``) with a certificate from trustme's throwaway CA,
so the daemon's fetches go over real TLS that it must verify.

What it serves: RFC 8414 metadata (``/.well-known/oauth-authorization-server``), the JWKS
(``/jwks``) and RFC 7662 introspection (``/introspect``, HTTP Basic client authentication). Tests
can rotate keys, take it down (it answers 500), and read how often each path was asked for.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import ssl
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import trustme
from joserfc import jwt
from joserfc.jwk import ECKey, KeySet, RSAKey

#: The daemon's canonical resource URI in the tests (what its tokens' ``aud`` must name).
RESOURCE = "https://mcp.example.test/mcp"
CLIENT_ID = "toolcell-rs"
CLIENT_SECRET = "introspection-secret-42"


class Issuer:
    def __init__(self, tmp: Path) -> None:
        self.ca = trustme.CA()
        self.ca_file = tmp / "issuer-ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        cert = self.ca.issue_cert("127.0.0.1", "localhost")
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        cert.configure_cert(self.ctx)
        self.rsa = RSAKey.generate_key(2048, parameters={"kid": "rsa-1", "use": "sig"})
        self.ec = ECKey.generate_key("P-256", parameters={"kid": "ec-1", "use": "sig"})
        self.published = [self.rsa, self.ec]
        self.hits: Counter[str] = Counter()
        self.down = False
        #: Opaque tokens the introspection endpoint knows: token -> its answer.
        self.opaque: dict[str, dict[str, Any]] = {}
        self.introspection_auth: list[str] = []
        self.token_requests: list[dict[str, str]] = []
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, doc: Any) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                issuer.hits[self.path] += 1
                if issuer.down:
                    return self._send(500, {"error": "down"})
                if self.path == "/.well-known/oauth-authorization-server":
                    return self._send(200, {"issuer": issuer.url, "jwks_uri": issuer.url + "/jwks",
                                            "authorization_endpoint": issuer.url + "/authorize",
                                            "token_endpoint": issuer.url + "/token",
                                            "introspection_endpoint": issuer.url + "/introspect",
                                            "response_types_supported": ["code"],
                                            "grant_types_supported": ["client_credentials"],
                                            "token_endpoint_auth_methods_supported": ["client_secret_basic"]})
                if self.path == "/jwks":
                    return self._send(200, KeySet(issuer.published).as_dict(private=False))
                self._send(404, {"error": "not found"})

            def do_POST(self) -> None:  # noqa: N802
                issuer.hits[self.path] += 1
                length = int(self.headers.get("content-length", "0"))
                form = urllib.parse.parse_qs(self.rfile.read(length).decode())
                if issuer.down or self.path not in ("/introspect", "/token"):
                    return self._send(500, {"error": "down"})
                issuer.introspection_auth.append(self.headers.get("authorization", ""))
                expected = "Basic " + base64.b64encode(f"{CLIENT_ID}:{CLIENT_SECRET}".encode()).decode()
                if self.headers.get("authorization") != expected:
                    return self._send(401, {"error": "invalid_client"})
                if self.path == "/token":  # RFC 6749 client_credentials, RFC 8707 resource
                    issuer.token_requests.append({k: v[0] for k, v in form.items()})
                    if form.get("grant_type") != ["client_credentials"]:
                        return self._send(400, {"error": "unsupported_grant_type"})
                    resource = form.get("resource", [RESOURCE])[0]
                    scope = form.get("scope", ["toolcell:*"])[0]
                    access = issuer.token(sub=CLIENT_ID, aud=resource, scope=scope)
                    return self._send(200, {"access_token": access, "token_type": "Bearer", "expires_in": 300,
                                            "scope": scope})
                token = form.get("token", [""])[0]
                self._send(200, issuer.opaque.get(token, {"active": False}))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = self.ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def token(self, *, key: Any = None, alg: str = "RS256", header: dict[str, Any] | None = None,
              **claims: Any) -> str:
        """A signed access token; ``claims`` override the defaults (None removes a claim)."""
        key = key or (self.ec if alg.startswith("ES") else self.rsa)
        now = int(time.time())
        body: dict[str, Any] = {"iss": self.url, "sub": "alice", "aud": RESOURCE, "iat": now,
                                "exp": now + 300, "scope": "toolcell:*"}
        body.update(claims)
        body = {k: v for k, v in body.items() if v is not None}
        head = {"alg": alg, "kid": key.kid, **(header or {})}
        return jwt.encode(head, body, key, algorithms=[head["alg"]])

    def hmac_token_with_public_key(self, **claims: Any) -> str:
        """The classic confusion attack: HS256 signed with the RSA *public* key's PEM as the secret."""
        pem = self.rsa.as_pem(private=False)
        now = int(time.time())
        body = {"iss": self.url, "sub": "mallory", "aud": RESOURCE, "exp": now + 300,
                "scope": "toolcell:*", **claims}
        # joserfc itself refuses to use a public key as an HMAC secret, so the attacker signs by hand.
        signing_input = f"{_b64({'alg': 'HS256', 'typ': 'JWT', 'kid': 'rsa-1'})}.{_b64(body)}"
        mac = hmac.new(pem, signing_input.encode(), hashlib.sha256).digest()
        return signing_input + "." + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()




def _b64(doc: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()


def unsigned_token(issuer_url: str, audience: str) -> str:
    """``alg: none``: no signature at all."""
    now = int(time.time())
    return _b64({"alg": "none", "typ": "JWT"}) + "." + _b64(
        {"iss": issuer_url, "sub": "mallory", "aud": audience, "exp": now + 300, "scope": "toolcell:*"}) + "."

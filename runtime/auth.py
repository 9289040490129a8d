"""Bearer-token authentication and scope-based tool visibility for the HTTP transport.

Tokens live in the config only as SHA-256 hex digests; a presented token is hashed and looked up,
so the daemon never holds (or logs) a usable secret. A principal's scopes pick the tools it may
see and call: ``*`` (all), ``plugin:NAME`` (one plugin's tools) or a glob on the public tool name.
Outside its scopes a tool is simply absent from the principal's catalog view, so it is
indistinguishable from a tool that does not exist.

``toolcell token [PRINCIPAL] [--scope SCOPE]...`` (also ``python -m runtime.auth``) mints a random
token and prints it with the ``[[http.tokens]]`` TOML to paste into the config.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import re
import secrets
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.http_config import HttpConfig, RateLimit, Token
from runtime.protocol.catalog import Catalog, ToolEntry


_PRINCIPAL = re.compile(r"^[A-Za-z0-9_.@][A-Za-z0-9_.@-]{0,63}$")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(eq=False)
class Principal:
    """Who is calling: a token's principal, or ``anonymous`` when authentication is off."""

    name: str
    scopes: tuple[str, ...] = ("*",)
    rate: RateLimit | None = None
    #: Authenticated by an OAuth access token (a tool outside its scopes is answered 403
    #: ``insufficient_scope`` so that the client can ask for more; static tokens see no such tool).
    oauth: bool = False
    all_tools: bool = field(init=False)
    _view_key: Any = field(init=False)

    def __post_init__(self) -> None:
        self.all_tools = "*" in self.scopes
        self._view_key = ("scopes", tuple(sorted(set(self.scopes))))

    def allows(self, entry: ToolEntry) -> bool:
        for scope in self.scopes:
            if scope == "*":
                return True
            if scope.startswith("plugin:"):
                if entry.plugin == scope[7:]:
                    return True
            elif fnmatch.fnmatchcase(entry.name, scope):
                return True
        return False

    def catalog(self, catalog: Catalog) -> Catalog | None:
        """The principal's view of ``catalog``; None means the whole (public) catalog."""
        if self.all_tools:
            return None
        return catalog.view(self._view_key, self.allows)


ANONYMOUS = Principal("anonymous")


class CheckedTokens(Protocol):
    """Tokens some other authority checked before (``runtime.oauth.OAuthVerifier``), by their exact
    ``Authorization`` value."""

    def cached(self, authorization: bytes) -> Principal | None: ...


class Authenticator:
    """Maps ``Authorization: Bearer`` values to principals. Disabled when no token is configured."""

    #: Authorization values already matched to a principal, kept so that a client's every request
    #: does not hash its token again. Only matches are kept (a stream of wrong tokens cannot grow
    #: it), at most this many; the oldest goes first.
    MATCHED_MAX = 1024

    def __init__(self, cfg: HttpConfig, oauth: CheckedTokens | None = None) -> None:
        self._by_hash: dict[str, Principal] = {}
        for tok in cfg.tokens:
            self._by_hash[tok.sha256] = Principal(tok.principal, tuple(tok.scopes), tok.rate)
        #: Checks OAuth access tokens (``[http.oauth]``); what it checked is remembered in it.
        self.oauth = oauth
        self.enabled = bool(self._by_hash) or oauth is not None
        self._matched: dict[bytes, Principal] = {}

    def static_principals(self) -> set[str]:
        """The principals the configured tokens name (OAuth's are not among them)."""
        return {p.name for p in self._by_hash.values()}

    def replace_tokens(self, tokens: list[Token]) -> str | None:
        """Take a new set of static tokens (``SIGHUP``: a token revoked or added without a restart);
        what was matched before is forgotten, so a removed token stops working at once. None when
        done; otherwise why not, and the tokens in use stay: the daemon never goes from checking
        tokens to letting anyone in, nor the other way while it serves."""
        if not self.enabled:
            return ("the daemon started without bearer tokens (it lets every client in); tokens added "
                    "since take a restart")
        by_hash = {tok.sha256: Principal(tok.principal, tuple(tok.scopes), tok.rate) for tok in tokens}
        if not by_hash and self.oauth is None:
            return "the configuration has no bearer token any more, which would let anyone in"
        self._by_hash = by_hash
        self._matched = {}
        return None

    def authenticate(self, authorization: bytes | None) -> Principal | None:
        """The principal for a request's Authorization header, or None (reject with 401)."""
        if not self.enabled:
            return ANONYMOUS
        if not authorization:
            return None
        known = self._matched.get(authorization)
        if known is not None:
            return known
        if self.oauth is not None:
            checked = self.oauth.cached(authorization)
            if checked is not None:
                return checked
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        if not token or len(token) > 4096:
            return None
        principal = self._by_hash.get(hashlib.sha256(token).hexdigest())
        if principal is not None:
            if len(self._matched) >= self.MATCHED_MAX:
                del self._matched[next(iter(self._matched))]
            self._matched[authorization] = principal
        return principal


TOKEN_EXAMPLES = """examples:
  toolcell token                                   a token for principal "client" that sees every tool
  toolcell token ci-bot --scope plugin:mathkit --scope 'text_*' >> toolcell.toml"""


def add_token_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``toolcell token``."""
    p.add_argument("principal", nargs="?", default="client",
                   help="who the token identifies (in logs, audit lines, rate limits; default: client)")
    p.add_argument("--scope", action="append", metavar="SCOPE", dest="scopes",
                   help="which tools it may see and call: '*' (default), plugin:NAME or a glob on the tool name; "
                        "repeatable")


def run_token(args: argparse.Namespace) -> int:
    """Mint a token: the secret on stderr (stored nowhere), the ``[[http.tokens]]`` TOML on stdout."""
    if not _PRINCIPAL.match(args.principal):
        print(f"toolcell token: principal {args.principal!r}: use 1-64 characters of letters, digits, '_', '.', "
              "'@', '-' (not starting with '-')", file=sys.stderr)
        return 2
    scopes = args.scopes or ["*"]
    for scope in scopes:
        if not scope or any(c in scope for c in '"\\\n'):
            print(f"toolcell token: scope {scope!r}: use '*', plugin:NAME or a glob on tool names", file=sys.stderr)
            return 2
    token = "tc_" + secrets.token_urlsafe(32)
    print(f"token (give it to the client; it is not stored anywhere): {token}", file=sys.stderr)
    scope_list = ", ".join(f'"{s}"' for s in scopes)
    print(f'[[http.tokens]]\nprincipal = "{args.principal}"\nsha256 = "{hash_token(token)}"\nscopes = [{scope_list}]')
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.auth", description="mint a bearer token (toolcell token)",
                                     epilog=TOKEN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_token_arguments(parser)
    return run_token(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

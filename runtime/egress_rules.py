"""Which destinations a plugin's network grant lets through the egress proxy (sans-io: no trio, no I/O).

A grant is the manifest's ``[permissions] network`` list of ``host:port`` entries. ``host`` is one of

* a DNS name, matched exactly and case-insensitively (``api.example.com``);
* ``*.example.com``: any name below ``example.com`` (not ``example.com`` itself);
* an IP literal (``203.0.113.7``, ``[2001:db8::1]``);
* ``localhost``: the loopback addresses, without asking DNS.

How a request for ``host:port`` is decided (``runtime.egress`` does the I/O in between):

1. ``Grant.match(host, port)``: the entry naming it, else refused ("not in the grant").
2. The daemon resolves the name itself (the plugin has no DNS) and ``vet(entry, addresses, own)``
   checks *every* address: refused if any is loopback, link-local (169.254.169.254 included),
   unspecified, multicast, private/ULA or otherwise not globally routable (IPv4 embedded in IPv6
   counts as itself), unless the entry is that IP literal, or ``localhost`` (loopback only); and
   refused if it is one of the daemon's own listening sockets on a local address, unless the entry
   is that exact IP literal. The daemon then dials a vetted address, never the name again (no DNS
   rebinding between the check and the connect).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
LOOPBACK = (ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv6Address("::1"))


class Refused(Exception):
    """A request the grant does not allow; ``status`` is the HTTP status the proxy answers with."""

    def __init__(self, reason: str, status: int = 403) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True)
class Entry:
    """One parsed grant entry. ``kind`` is "name", "wildcard", "ip" or "localhost"."""

    host: str
    port: int
    kind: str
    ip: IPAddress | None = None

    def __str__(self) -> str:
        host = f"[{self.host}]" if self.ip is not None and self.ip.version == 6 else self.host
        return f"{host}:{self.port}"


def ip_literal(host: str) -> IPAddress | None:
    """``host`` as an IP address (brackets allowed around IPv6), else None."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def normalize_host(host: str) -> str:
    """Lower-case, one trailing dot dropped; raises ``ValueError`` unless it is a DNS name or IP literal."""
    ip = ip_literal(host)
    if ip is not None:
        return str(ip)
    name = host.lower().removesuffix(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in name.split(".")):
        raise ValueError(f"{host!r} is not a host name or IP address")
    return name


def split_host_port(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host without brackets, port). Raises ``ValueError``."""
    if "/" in text or "@" in text:
        raise ValueError(f"{text!r}: use host:port, not a URL")
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r}: use host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r}: the port must be 1-65535")
    if host.startswith("["):
        ip = ip_literal(host) if host.endswith("]") else None
        if ip is None or ip.version != 6:
            raise ValueError(f"{text!r}: brackets are only for an IPv6 address")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, [addr]:port")
    return host, int(port)


def parse_entry(text: str) -> Entry:
    """One manifest entry; raises ``ValueError`` saying what is wrong with it."""
    host, port = split_host_port(text.strip())
    ip = ip_literal(host)
    if ip is not None:
        return Entry(str(ip), port, "ip", ip)
    if host.startswith("*."):
        domain = normalize_host(host[2:])
        if "." not in domain or ip_literal(domain) is not None:
            raise ValueError(f"{text!r}: a wildcard needs a domain of two labels or more (*.example.com)")
        return Entry("*." + domain, port, "wildcard")
    if "*" in host:
        raise ValueError(f"{text!r}: a wildcard may only be a leading '*.' label")
    name = normalize_host(host)
    return Entry(name, port, "localhost" if name == "localhost" else "name")


def _embedded_v4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    if ip.version != 6:
        return None
    assert isinstance(ip, ipaddress.IPv6Address)
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_problem(ip: IPAddress) -> str | None:
    """Why ``ip`` may not be dialled without an explicit grant for it (None: a public address)."""
    for candidate in (_embedded_v4(ip), ip):  # the embedded IPv4 address says more than its wrapper
        if candidate is None:
            continue
        if candidate.is_loopback:
            return "loopback"
        if candidate.is_link_local:
            return "link-local"
        if candidate.is_unspecified:
            return "unspecified"
        if candidate.is_multicast:
            return "multicast"
        if candidate.is_private:
            return "private"
        if not candidate.is_global:
            return "not globally routable"
    return None


@dataclass(frozen=True)
class Own:
    """The daemon's own listening sockets (address, port; ``0.0.0.0``/``::`` = any) and local addresses."""

    listening: frozenset[tuple[IPAddress, int]] = frozenset()
    local: frozenset[IPAddress] = frozenset()

    def is_daemon(self, ip: IPAddress, port: int) -> bool:
        for addr, lport in self.listening:
            if lport != port:
                continue
            if addr == ip:
                return True
            if addr.is_unspecified and (ip.is_loopback or ip in self.local):
                return True
        return False


class Grant:
    """A plugin's parsed network grant (see the module doc)."""

    def __init__(self, entries: Iterable[Entry]) -> None:
        self.entries = tuple(entries)

    @classmethod
    def parse(cls, texts: Iterable[str]) -> Grant:
        return cls(parse_entry(t) for t in texts)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def match(self, host: str, port: int) -> Entry:
        """The entry naming ``host:port``; raises ``Refused`` when none does."""
        try:
            name = normalize_host(host)
        except ValueError as exc:
            raise Refused(str(exc), 400) from None
        for entry in self.entries:
            if entry.port != port:
                continue
            if entry.kind == "wildcard":
                if name.endswith(entry.host[1:]) and ip_literal(name) is None:
                    return entry
            elif entry.host == name:
                return entry
        raise Refused(f"{host}:{port} is not in the plugin's network grant")


def vet(entry: Entry, addresses: Iterable[IPAddress], own: Own) -> list[IPAddress]:
    """The addresses the proxy may dial for ``entry``, in order; raises ``Refused`` if any is off limits."""
    out: list[IPAddress] = []
    for ip in addresses:
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
            raise Refused(f"{ip}: scoped addresses are never dialled")
        explicit = entry.kind == "ip" and entry.ip == ip
        if not explicit:
            problem = address_problem(ip)
            if problem and not (entry.kind == "localhost" and problem == "loopback"):
                raise Refused(f"{entry.host} resolves to {ip}, a {problem} address not named in the grant")
            if own.is_daemon(ip, entry.port):
                raise Refused(f"{ip}:{entry.port} is the daemon's own listening port")
        if ip not in out:
            out.append(ip)
    if not out:
        raise Refused(f"{entry.host} has no address", 502)
    return out

"""The tool catalog: an immutable, versioned snapshot of every servable tool, sorted by name.

``tools/list`` pages are encoded once per (catalog version, revision shape, view, page) and then
served as bytes, so a 10,000-tool listing costs a dictionary lookup per request.

Cursors are opaque to clients but are keyset cursors inside: ``catalog version, offset, last name``.
Within one version the offset picks a cached page; after a reload (a new version) the listing
continues right after the last name the client saw, so it is never silently wrong: a tool added
before that name is simply not in this pass, which is what ``list_changed`` tells the client.
"""

from __future__ import annotations

import base64
import hashlib
import bisect
import binascii
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, cast

import msgspec

from runtime.protocol import eras
from runtime.protocol.schemas import CheckedTool

if TYPE_CHECKING:  # the seam's type only: the protocol package imports nothing of the daemon at run time
    from runtime.execution.runner import Runner

_encoder = msgspec.json.Encoder()
DEFAULT_PAGE_SIZE = 100


@dataclass(eq=False)
class ToolEntry:
    """A servable tool: its public name, the plugin that provides it and its checked definition."""

    name: str
    plugin: str
    local_name: str
    checked: CheckedTool
    #: What runs calls for this tool (the plugin's worker pool or hosted server); None only in tests
    #: of the protocol core, which never run a call.
    runner: Runner = cast("Runner", None)
    _encoded: dict[str, bytes] = field(default_factory=dict)

    def encoded(self, version: str) -> bytes:
        """The Tool object as JSON for ``version`` (cached)."""
        cached = self._encoded.get(version)
        if cached is not None:
            return cached
        spec = self.checked.spec
        obj: dict[str, Any] = {"name": self.name}
        fields = eras.tool_fields(version)
        if spec.title is not None and "title" in fields:
            obj["title"] = spec.title
        obj["description"] = spec.description
        obj["inputSchema"] = spec.input_schema
        if spec.output_schema is not None and "outputSchema" in fields:
            obj["outputSchema"] = spec.output_schema
        if spec.annotations and "annotations" in fields:
            ann = dict(spec.annotations)
            obj["annotations"] = ann
        if spec.icons and "icons" in fields:
            obj["icons"] = spec.icons
        if spec.meta and "_meta" in fields:
            obj["_meta"] = spec.meta
        if spec.task_support != "forbidden" and "execution" in fields:
            obj["execution"] = {"taskSupport": spec.task_support}
        data = _encoder.encode(obj)
        self._encoded[version] = data
        return data


class CursorError(ValueError):
    """The cursor was not issued by this server (or is damaged)."""


def _encode_cursor(catalog_version: int, offset: int, last_name: str) -> str:
    raw = _encoder.encode([catalog_version, offset, last_name])
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _decode_cursor(cursor: Any) -> tuple[int, int, str]:
    if not isinstance(cursor, str) or len(cursor) > 512:
        raise CursorError("cursor must be a string issued by this server")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        version, offset, last = msgspec.json.decode(raw)
    except (binascii.Error, ValueError, TypeError, msgspec.DecodeError):
        raise CursorError("invalid cursor") from None
    if not (type(version) is int and type(offset) is int and isinstance(last, str) and offset > 0):
        raise CursorError("invalid cursor")
    return version, offset, last


class Catalog:
    """An immutable set of tools at one version. Views restrict it (authorization scopes)."""

    #: Views kept per catalog (one per distinct scope set; OAuth tokens can carry any subset of what
    #: the identity provider grants, so they are bounded; the oldest goes first and is recomputed).
    VIEWS_MAX = 1024

    def __init__(self, version: int, entries: Iterable[ToolEntry], page_size: int = DEFAULT_PAGE_SIZE) -> None:
        self.version = version
        self.page_size = max(1, page_size)
        self.entries: tuple[ToolEntry, ...] = tuple(sorted(entries, key=lambda e: e.name))
        self.by_name: dict[str, ToolEntry] = {e.name: e for e in self.entries}
        self._names = [e.name for e in self.entries]
        self._pages: dict[tuple[str, int], tuple[bytes, str | None]] = {}
        self._views: dict[Any, Catalog] = {}
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        """A digest of every tool definition as ``tools/list`` shows it (not of the version number):
        replicas serving the same plugins have the same fingerprint, so a balancer's monitoring can
        tell a replica whose catalog differs (``/healthz``, the ``toolcell_catalog_info`` metric)."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for entry in self.entries:
                digest.update(entry.encoded(eras.V2026_07_28))
                digest.update(b"\n")
            self._fingerprint = digest.hexdigest()[:32]
        return self._fingerprint

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, name: str) -> ToolEntry | None:
        return self.by_name.get(name)

    def view(self, key: Any, allowed: Callable[[ToolEntry], bool]) -> Catalog:
        """The sub-catalog of tools ``allowed`` admits; cached by ``key`` for this version."""
        cached = self._views.get(key)
        if cached is None:
            cached = Catalog(self.version, [e for e in self.entries if allowed(e)], self.page_size)
            if len(self._views) >= self.VIEWS_MAX:
                del self._views[next(iter(self._views))]
            self._views[key] = cached
        return cached

    def page(self, version: str, cursor: Any = None) -> tuple[bytes, str | None]:
        """``(JSON array of tools, nextCursor or None)`` for one page of ``tools/list``."""
        if cursor is None:
            offset = 0
        else:
            cat_version, offset, last_name = _decode_cursor(cursor)
            if cat_version != self.version or offset > len(self.entries) or (
                offset and self._names[offset - 1] != last_name
            ):
                # Issued by an older catalog: continue after the last name the client saw.
                offset = bisect.bisect_right(self._names, last_name)
                return self._encode_page(version, offset)
        if offset % self.page_size == 0:
            key = (eras.SHAPE_OF[version], offset)
            page = self._pages.get(key)
            if page is None:
                page = self._encode_page(version, offset)
                self._pages[key] = page
            return page
        return self._encode_page(version, offset)

    def _encode_page(self, version: str, offset: int) -> tuple[bytes, str | None]:
        chunk = self.entries[offset : offset + self.page_size]
        body = b"[" + b",".join(e.encoded(version) for e in chunk) + b"]"
        end = offset + len(chunk)
        next_cursor = _encode_cursor(self.version, end, self._names[end - 1]) if end < len(self.entries) else None
        return body, next_cursor

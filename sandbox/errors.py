"""The exception a tool raises to fail its call with a message meant for the model."""

from __future__ import annotations


class ToolError(Exception):
    """Raise to fail a call with a message meant for the model (an ``isError`` result)."""


class RequestError(Exception):
    """Raise when the request itself is invalid (not a failure of the tool's work): the client gets
    a JSON-RPC error -32602 with this message instead of an ``isError`` result (a task ends
    ``failed``). For everything a model could correct by calling again, prefer ``ToolError``."""

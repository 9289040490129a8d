"""The exception a tool raises to fail its call with a message meant for the model."""

from __future__ import annotations


class ToolError(Exception):
    """Raise to fail a call with a message meant for the model (an ``isError`` result)."""

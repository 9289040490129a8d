"""A single no-op tool for the load benchmark: measures the daemon's per-call overhead."""

from sandbox import tool


@tool(annotations={"readOnlyHint": True, "idempotentHint": True, "openWorldHint": False})
def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: The text to send back.
    """
    return text

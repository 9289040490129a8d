"""Worker side of toolcell: the plugin authoring API, the worker loop and its isolation.

Never imports trio. Plugins import the authoring API from here::

    from sandbox import tool, current, image, ToolError
"""

from sandbox.api import (
    CallContext,
    ToolError,
    ToolResult,
    audio,
    current,
    embedded_blob,
    embedded_text,
    image,
    resource_link,
    text,
    tool,
)
from sandbox.errors import RequestError

__all__ = [
    "CallContext",
    "RequestError",
    "ToolError",
    "ToolResult",
    "audio",
    "current",
    "embedded_blob",
    "embedded_text",
    "image",
    "resource_link",
    "text",
    "tool",
]

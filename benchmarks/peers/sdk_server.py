"""The official MCP Python SDK server (``mcp`` 2.x) exposing one ``echo`` tool.

This is the peer toolcell is measured against. It uses the SDK's high-level
``MCPServer`` exactly as its documentation shows, with no tuning beyond the
transport mode chosen on the command line::

    python benchmarks/peers/sdk_server.py                       # stdio
    python benchmarks/peers/sdk_server.py --http --port 8765    # Streamable HTTP

Over HTTP it runs stateless with JSON responses (no sessions, no SSE), which is
the SDK's fastest HTTP mode; the endpoint is ``http://HOST:PORT/mcp``.
"""

from __future__ import annotations

import argparse

from mcp.server.mcpserver import MCPServer

server = MCPServer("sdk-echo", log_level="WARNING")


@server.tool()
def echo(text: str) -> str:
    """Return ``text`` unchanged."""
    return text


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve until stdin closes or the process is stopped."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", action="store_true", help="serve Streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    if args.http:
        server.run("streamable-http", host=args.host, port=args.port, stateless_http=True, json_response=True)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()

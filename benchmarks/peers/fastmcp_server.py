"""A FastMCP (``fastmcp`` 4.x) server exposing one ``echo`` tool, as a second peer.

FastMCP is not a project dependency and pins its own ``mcp``; install it in a
separate virtual environment so the project's ``mcp==2.3.0`` stays untouched::

    python -m venv /tmp/fastmcp-venv
    /tmp/fastmcp-venv/bin/pip install fastmcp
    /tmp/fastmcp-venv/bin/python benchmarks/peers/fastmcp_server.py               # stdio
    /tmp/fastmcp-venv/bin/python benchmarks/peers/fastmcp_server.py --http --port 8766

Over HTTP it runs stateless with JSON responses, its fastest HTTP mode; the
endpoint is ``http://HOST:PORT/mcp``. ``benchmarks/run.py`` looks for the
interpreter in ``$FASTMCP_PYTHON``, then ``/tmp/fastmcp-venv/bin/python``.
"""

from __future__ import annotations

import argparse

from fastmcp import FastMCP

server = FastMCP("fastmcp-echo")


@server.tool
def echo(text: str) -> str:
    """Return ``text`` unchanged."""
    return text


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve until stdin closes or the process is stopped."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", action="store_true", help="serve Streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8766)
    args = parser.parse_args(argv)
    if args.http:
        server.run(
            "http",
            show_banner=False,
            host=args.host,
            port=args.port,
            log_level="WARNING",
            stateless_http=True,
            json_response=True,
        )
    else:
        server.run("stdio", show_banner=False, log_level="WARNING")


if __name__ == "__main__":
    main()

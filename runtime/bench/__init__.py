"""``toolcell bench``: load-benchmark any MCP server (stdio command, HTTP URL, or toolcell itself).

Nothing here is imported by the daemon: the bench is a client, with its own dependencies (the
``bench`` extra). ``runtime.bench.cli`` is the entry point; ``runtime.bench.runner`` runs a whole
benchmark; the transports' load loops are ``runtime.bench.stdio_client`` and
``runtime.bench.http_client``.
"""

"""toolcell daemon side: transports, the MCP protocol core, registry, scheduling, workers (trio)."""

__version__ = "0.1.0"

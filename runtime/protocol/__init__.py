"""The MCP protocol, sans-io: JSON-RPC envelopes, revisions, and the server core. Never imports trio."""

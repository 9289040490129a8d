"""Thin trio adapters between byte streams and the sans-io protocol core."""

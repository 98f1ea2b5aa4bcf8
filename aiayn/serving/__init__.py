"""The HTTP API with cross-request batching, and its page."""

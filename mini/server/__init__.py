"""OpenAI-compatible HTTP server over the async engine (`mini serve`)."""
from mini.server.app import build_app, create_app, serve

__all__ = ["build_app", "create_app", "serve"]

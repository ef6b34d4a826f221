"""OpenAI-compatible HTTP server over the async engine (`mini serve`)."""
from mini.server.app import add_serve_args, build_app, create_app, serve

__all__ = ["add_serve_args", "build_app", "create_app", "serve"]

"""An OpenAI-compatible HTTP server over one `Spirit` (FastAPI + uvicorn).

    spirit serve --model qwen2.5-coder-0.5b --method spirit --host 127.0.0.1 --port 8000

or from Python: `create_app(lm, ServerConfig(...))` for any ASGI server, `ServerThread(lm)`
for a live server on a free loopback port. See docs/server.md.
"""

from spirit.server.app import ServerConfig, create_app
from spirit.server.launcher import ServerThread, serve

__all__ = ["ServerConfig", "ServerThread", "create_app", "serve"]

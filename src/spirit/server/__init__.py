"""An OpenAI-compatible HTTP server over one `Spirit` (FastAPI + uvicorn).

    spirit serve --model qwen2.5-coder-0.5b --method spirit --host 127.0.0.1 --port 8000

or from Python: `create_app(lm, ServerConfig(...))` for any ASGI server, `ServerThread(lm)`
for a live server on a free loopback port. See docs/server.md.

fastapi and uvicorn come with the `serve` extra. Importing this package must work without
them (`spirit serve` is registered from `spirit.server.cli` whatever is installed, and says
which extra to install when run), so the names below load their modules on first use.
"""

from __future__ import annotations

from importlib import import_module
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spirit.server.app import create_app
    from spirit.server.config import ServerConfig
    from spirit.server.launcher import ServerThread, serve

_HOMES = MappingProxyType({
    "ServerConfig": "spirit.server.config",
    "create_app": "spirit.server.app",
    "ServerThread": "spirit.server.launcher",
    "serve": "spirit.server.launcher",
})

__all__ = ["ServerConfig", "ServerThread", "create_app", "serve"]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(home), name)

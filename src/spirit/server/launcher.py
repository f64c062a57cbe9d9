"""Run the app with uvicorn: in the foreground (`serve`) or on a thread (`ServerThread`, for
tests, benchmarks and notebooks), always on a socket this process opened itself."""

from __future__ import annotations

import copy
import socket
import threading
import time

import uvicorn
import uvicorn.config

from spirit.api import Spirit
from spirit.server.app import ServerConfig, create_app


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    return sock


def _log_config(log_level: str) -> dict:
    """uvicorn's own logging setup, with spirit's loggers on its console handler: the server's
    internal errors are logged there with their tracebacks (clients get only a reference)."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["spirit"] = {"handlers": ["default"], "level": log_level.upper()}
    return config


def _uvicorn(app, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug", lifespan="on",
                            timeout_graceful_shutdown=5, log_config=_log_config(log_level))
    return uvicorn.Server(config)


def serve(lm: Spirit, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C)."""
    sock = _bind(host, port)
    _uvicorn(create_app(lm, config), log_level).run(sockets=[sock])


class ServerThread:
    """A live server on a loopback port chosen by the OS, run on a daemon thread.

        with ServerThread(tiny_spirit("llama"), ServerConfig(method="vanilla")) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, lm: Spirit, config: ServerConfig = ServerConfig(), host: str = "127.0.0.1",
                 port: int = 0, log_level: str = "warning") -> None:
        self.app = create_app(lm, config)
        self._sock = _bind(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self._server = _uvicorn(self.app, log_level)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="spirit-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

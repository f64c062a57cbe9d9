"""The server's settings, checked once when made: `ServerConfig`.

Kept apart from the app so that it imports nothing from the serve extra (fastapi, uvicorn).
"""

from __future__ import annotations

from dataclasses import dataclass

from spirit.policies import REGISTRY
from spirit.server import methods
from spirit.skipset import SkipSet

# 1 MiB: a full 32k-token context as JSON text or token ids is a few hundred KiB (chat text
# escaped as \uXXXX at most ~6 bytes a character), so real prompts fit with room to spare,
# while the parser, the validator and the tokenizer never see more than this from one client
DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """How the server serves; every field is checked here, so a bad one fails at start."""

    method: str = "spirit"  # decoding method when a request names none (the adaptive default)
    max_queue: int = 16  # requests that may wait behind the running ones; more get a 429
    max_batch: int = 1  # requests decoded together (continuous batching); 1 = one at a time
    request_timeout_s: float | None = 300.0  # queue wait + generation; None = no limit
    api_key: str | None = None  # Bearer token required on every route but /health
    model_name: str | None = None  # the name clients use; default the model's own name
    skip: str | None = None  # the skip set of --method static
    chat_max_tokens: int = 512  # chat requests without max_tokens: this, or the context left
    poll_s: float = 0.25  # how often a waiting request checks that its client is still there
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413, unparsed and untokenized
    # the methods a request may name; None = methods.default_allowed: --method and those that
    # start no offline calibration and no quantization build of their own
    allow_methods: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        # the server's own options, checked once here (a request's are checked by Request)
        if self.method not in REGISTRY.names():
            raise ValueError(f"unknown method {self.method!r} for the server; choose one of {', '.join(REGISTRY.names())}")
        if self.method == "static" and not self.skip:
            raise ValueError("--method static needs --skip, e.g. --skip 'attn:4,9;mlp:4,9,12'")
        if self.skip:
            SkipSet.parse(self.skip)  # a malformed --skip fails at start, not in the first request
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout_s}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if self.allow_methods is not None:
            given = self.allow_methods
            # a list or a comma-separated string from Python callers, kept as a tuple
            object.__setattr__(self, "allow_methods", methods.parse_methods(given) if isinstance(given, str)
                               else tuple(dict.fromkeys(given)))
            methods.check_allowed(self.allow_methods, self.method, self.skip)

    @property
    def allowed_methods(self) -> tuple[str, ...]:
        """The methods a request may name (--allow-methods, or the safe default)."""
        if self.allow_methods is not None:
            return self.allow_methods
        return methods.default_allowed(self.method, self.skip)

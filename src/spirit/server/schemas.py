"""Request bodies of the OpenAI-compatible routes, validated by pydantic.

Only the fields spirit can honour are accepted with a value other than their default; fields
a client library sends routinely (user, stream_options, zero penalties) are accepted and
ignored, and anything unknown is ignored too, as OpenAI-compatible servers usually do.
Three extensions: `method` (the decoding method, default the server's `--method`), `top_k`
and `sampling_mode` (gumbel, rejection or auto: see spirit.sampling).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Largest max_tokens accepted by the schema; the real bound is the model's context, checked
# against the encoded prompt once the prompt is known.
MAX_TOKENS_LIMIT = 1 << 20
MAX_STOP_STRINGS = 4  # OpenAI's limit


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None  # None = the served model (OpenAI requires it; curl users forget)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's range and default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1 << 20)  # extension: 0 keeps every token
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # what torch.Generator accepts
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    method: str | None = None  # extension: the decoding method, default the server's --method
    # extension: "gumbel" (a seeded request's text repeats whatever the draft), "rejection", or
    # "auto" (gumbel when seeded)
    sampling_mode: Literal["auto", "gumbel", "rejection"] = "auto"

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported (one generation at a time)")
        return n

    @model_validator(mode="after")
    def _no_penalties(self):
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported; leave them at 0")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    # a string, one string in a list, token ids, or one list of token ids (batches are n > 1's cousin)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS_LIMIT)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt is empty")
            if isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise ValueError("only one prompt per request is supported")
                prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt

    @model_validator(mode="after")
    def _unsupported(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)  # the newer name
    logprobs: bool = False
    tools: list | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.logprobs:
            raise ValueError("logprobs is not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

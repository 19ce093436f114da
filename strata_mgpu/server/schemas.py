"""Request bodies of the OpenAI-compatible API (pydantic), and their sampling parameters."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from strata_mgpu.engine.sampler import SamplingParams


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Generation(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self, max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p, seed=self.seed,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              stop=stop, ignore_eos=self.ignore_eos)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Generation):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions


class TokenizeRequest(BaseModel):
    """llama.cpp's `content` or vLLM's `prompt`: exactly one of them."""

    content: str | None = None
    prompt: str | None = None
    add_special: bool = False

    @model_validator(mode="after")
    def _one_text(self) -> TokenizeRequest:
        if (self.content is None) == (self.prompt is None):
            raise ValueError("give the text as either 'content' or 'prompt'")
        return self

    @property
    def text(self) -> str:
        text = self.content if self.content is not None else self.prompt
        assert text is not None, "_one_text holds one of them"
        return text


class DetokenizeRequest(BaseModel):
    tokens: list[int]

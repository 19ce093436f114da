"""Request bodies of the OpenAI-compatible API (pydantic), strict, and their sampling parameters.

Strict: a known field of the wrong type or value is a 400 naming it (no "5" for 5, no 1 for
true); a known option this server has not built (`n` > 1, `echo`, `best_of`, ...) is a 400
naming it and saying what to send instead; a field nobody knows is accepted, and logged once per
name. Checks that need the model or several fields together are the handlers'.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from strata_mgpu.engine.grammar import Grammar
from strata_mgpu.engine.sampler import MAX_TOP_LOGPROBS, SamplingParams

log = logging.getLogger("strata.server")

MAX_LEGACY_LOGPROBS = 5  # OpenAI's bound on completions' logprobs
REASONING_EFFORTS = ("low", "medium", "high")  # gpt-oss's levels (its system message's `Reasoning: ...`)
MAX_LOGIT_BIAS = 100.0

_unknown_seen: set[str] = set()
_unknown_lock = threading.Lock()


def log_unknown_fields(where: str, names: list[str]) -> None:
    for name in names:
        key = f"{where}.{name}"
        with _unknown_lock:
            if key in _unknown_seen:
                continue
            _unknown_seen.add(key)
        log.info("%s: accepting and ignoring the unknown field %r (logged once)", where, name)


class _Strict(BaseModel):
    """Known fields typed strictly; unknown fields kept (`model_extra`) for the log and the template."""

    model_config = ConfigDict(strict=True, extra="allow")


# -- messages ---------------------------------------------------------------------------------------

class FunctionCallIn(_Strict):
    name: str
    arguments: dict[str, Any]  # given as OpenAI's JSON string (or as an object; "": {}), kept parsed

    @field_validator("arguments", mode="before")
    @classmethod
    def _json_object(cls, v: Any) -> Any:
        if isinstance(v, str) and not v.strip():
            return {}  # a call of no arguments, as some clients write it
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"not JSON ({e.msg} at character {e.pos}): a call's arguments are a JSON "
                                 f"object, as a string") from None
            if not isinstance(v, dict):
                raise ValueError(f"a call's arguments are a JSON object, not {type(v).__name__} {v!r}")
        elif not isinstance(v, dict):
            raise ValueError("expected the call's arguments as a JSON object in a string (or as an object)")
        return v


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    """One message as given; `messages.template_messages` checks its content parts and makes it what
    templates read."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if v is None or isinstance(v, str | list):
            return v
        raise ValueError("expected a string, a list of content parts or null")

    @model_validator(mode="after")
    def _by_role(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the 'tool_call_id' of the call it answers")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry 'tool_calls'")
        return self


# -- tools, response formats --------------------------------------------------------------------------

class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICES = ("none", "auto", "required")


def tool_choice_of(v: Any) -> Any:
    """A tool_choice as given -> 'none' | 'auto' | 'required' | NamedToolChoice | None (ValueError else)."""
    if v is None or v in TOOL_CHOICES:
        return v
    if isinstance(v, dict):
        try:
            return NamedToolChoice.model_validate(v)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"a named tool choice is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                             f"({where}: {first['msg']})") from None
    raise ValueError("expected 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}")


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs its 'json_schema': {\"name\": ..., \"schema\": {...}}")
        return self

    @property
    def schema_of_answer(self) -> dict[str, Any] | None:
        """The JSON schema the answer must follow (None: free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            assert self.json_schema is not None
            return self.json_schema.json_schema or {"type": "object"}
        return None


class StreamOptions(_Strict):
    include_usage: bool = False


# -- the two endpoints --------------------------------------------------------------------------------

class _Generation(_Strict):
    """Fields shared by chat and text completions."""

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
    n: int = 1
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        stops = [v] if isinstance(v, str) else v
        if v is None:
            return v
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("expected a string or a list of strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported: one choice a request (send several requests)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids: {key!r} is not one")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS or math.isnan(bias):
                raise ValueError(f"biases are in -100..100: {key} has {bias}")
        return v

    @model_validator(mode="after")
    def _log_unknown(self) -> _Generation:
        log_unknown_fields(type(self).__name__, sorted(self.model_extra or {}))
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """Alternatives a token's logprobs come with (None: no logprobs)."""
        return None

    def sampling(self, max_tokens: int, vocab_size: int, *, grammar: Grammar | None = None,
                 banned: tuple[int, ...] = ()) -> SamplingParams:
        """Raises ValueError (a 400) for a token id out of range."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        bias = [(int(k), b) for k, b in (self.logit_bias or {}).items()]
        if any(t >= vocab_size for t, _ in bias):
            raise ValueError(f"logit_bias: token ids are in 0..{vocab_size - 1}")
        bias += [(t, float("-inf")) for t in banned]
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p, seed=self.seed,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              stop=stop, ignore_eos=self.ignore_eos, logit_bias=tuple(bias), grammar=grammar,
                              logprobs=self.requested_logprobs())


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # known options not built here: a 400 where given (other than their defaults)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None  # a template variable where the template reads it (gpt-oss's)
    verbosity: Any = None
    store: Any = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        return tool_choice_of(v)

    @field_validator("functions", "function_call")
    @classmethod
    def _legacy_functions(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("the legacy functions API is not supported: send 'tools' (and 'tool_choice') instead")
        return v

    @field_validator("audio", "prediction", "web_search_options", "verbosity")
    @classmethod
    def _unbuilt(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("not supported by this server: leave it out")
        return v

    @field_validator("reasoning_effort")
    @classmethod
    def _effort(cls, v: Any) -> Any:
        """gpt-oss's levels (its template writes them); whether the model reads one: `prepare_chat`."""
        if v is not None and v not in REASONING_EFFORTS:
            raise ValueError(f"one of {', '.join(map(repr, REASONING_EFFORTS))}, for a model whose chat template reads "
                             f"it (gpt-oss's); elsewhere thinking is on or off, chat_template_kwargs.enable_thinking")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if v not in (None, ["text"]):
            raise ValueError("this model takes and gives text only: leave modalities out or send [\"text\"]")
        return v

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v: Any) -> Any:
        if v not in (None, False):
            raise ValueError("this server stores no completions: leave store out or false")
        return v

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, v: str | None) -> str | None:
        if v not in (None, "auto", "default"):
            raise ValueError("this server has one service tier: leave it out, or 'auto' or 'default'")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def offered_tools(self) -> list[ToolDef]:
        """The tools the model is told of: none under tool_choice 'none' (it must not call)."""
        return [] if self.tool_choice == "none" else list(self.tools or [])


class CompletionRequest(_Generation):
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LEGACY_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]  # a list holding one prompt is that prompt
        if isinstance(v, str):
            if not v:
                raise ValueError("the prompt is empty")
            return v
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                return v
            if all(isinstance(p, str | list) for p in v):
                raise ValueError("a list of prompts is not supported; send one prompt a request")
        raise ValueError("the prompt must be a string or a list of token ids")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("not supported: the response carries the completion only")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of = 1 is supported: one candidate a request")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("not supported (no insertion): send the text before it as the prompt")
        return v

    def requested_logprobs(self) -> int | None:
        return self.logprobs


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

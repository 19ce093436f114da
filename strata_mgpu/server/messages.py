"""A chat's messages made what chat templates read, and its tool history checked as OpenAI checks it.

Templates are written for what `apply_chat_template` callers pass them, not for OpenAI's wire
format: Qwen3's does `'</think>' in message.content` (a null content is a TypeError there, a list
of parts is dropped), Qwen3-Coder's iterates `tool_call.arguments|items` (a JSON string is a
TypeError there). So before any template, each message becomes:

- `content` a string: null -> "", a list of text parts -> their texts joined (an assistant's
  `refusal` parts among them, as text); any other part (an image, audio, a file) is a 400 naming
  it (`messages[2].content[1].type`);
- `developer` -> `system` (the templates know no developer role);
- a call's `arguments` a mapping, so a call is shown to the model in the form it writes calls;
  `tool_calls` null or empty left out (gpt-oss's template takes the key's presence for calls);
- reasoning under any of its names also under the names templates read (`reasoning_content`,
  `thinking`), as transformers does;
- everything else as given.

A tool's definition gets `parameters` where it has none (Qwen3-Coder's template reads
`tool.parameters.properties`). A `tool` message must answer a call an earlier assistant message
made, else a 400 naming it (OpenAI's check).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from strata_mgpu.server.errors import APIError
from strata_mgpu.server.schemas import ChatMessage, ToolDef

NON_TEXT_PARTS = frozenset({"image_url", "image", "input_image", "input_audio", "audio", "file", "input_file",
                            "video", "video_url"})
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # what a client may call an answer's reasoning
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as templates read them (APIError 400 naming the field where one cannot be)."""
    check_tool_history(messages)
    return [_template_message(i, m) for i, m in enumerate(messages)]


def template_tools(tools: Sequence[ToolDef]) -> list[dict[str, Any]]:
    out = []
    for t in tools:
        tool = t.model_dump(exclude_unset=True)
        if tool["function"].get("parameters") is None:
            tool["function"]["parameters"] = dict(NO_PARAMETERS)
        out.append(tool)
    return out


def check_tool_history(messages: Sequence[ChatMessage]) -> None:
    called: list[str] = []
    for i, m in enumerate(messages):
        if m.role == "assistant":
            called += [c.id for c in m.tool_calls or () if c.id is not None]
        elif m.role == "tool" and m.tool_call_id not in called:
            made = f"the calls made: {', '.join(map(repr, called))}" if called else "no earlier message made a call"
            raise APIError(400, f"messages[{i}].tool_call_id: {m.tool_call_id!r} answers no call of an earlier "
                                f"assistant message ({made})", param=f"messages[{i}].tool_call_id")


def _template_message(i: int, m: ChatMessage) -> dict[str, Any]:
    message = m.model_dump(exclude_unset=True)  # unknown fields too: a template may read them
    if not message.get("tool_calls"):  # null or [] is no calls (gpt-oss's template tests `"tool_calls" in message`)
        message.pop("tool_calls", None)
    if message["role"] == "developer":
        message["role"] = "system"
    message["content"] = _text(i, m.content, refusals=m.role == "assistant")
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _text(i: int, content: str | list[Any] | None, refusals: bool = False) -> str:
    """The content as one string; `refusals`: an assistant's `refusal` parts are text too."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise APIError(400, f"{where}: a content part is an object with a 'type'", param=where)
        if kind in NON_TEXT_PARTS:
            raise APIError(400, f"{where}.type: this model takes text only (the part is {kind!r})",
                           param=f"{where}.type")
        if kind != "text" and not (kind == "refusal" and refusals):
            raise APIError(400, f"{where}.type: {kind!r} is no content part type known here (send 'text' parts)",
                           param=f"{where}.type")
        text = part.get(kind)
        if not isinstance(text, str):
            raise APIError(400, f"{where}.{kind}: a {kind} part needs its {kind!r}, a string", param=f"{where}.{kind}")
        texts.append(text)
    return "".join(texts)

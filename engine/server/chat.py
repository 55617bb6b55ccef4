"""Chat messages -> prompt token ids.

OpenAI messages are normalized to what a Hugging Face chat template expects (role + plain-text content),
then rendered by the engine's tokenizer through `EngineClient.apply_chat_template`: the checkpoint's
`chat_template` (tokenizer_config.json, or chat_template.jinja) in jinja2's immutable sandbox, or ChatML
when the checkpoint has none (engine/model/tokenizer.py; documented in docs/API.md). One renderer for the
whole engine, so `generate` and the server build the same prompt for the same messages.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine.api import EngineClient
from engine.server.errors import ApiError, invalid_param, unsupported_param


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI messages (pydantic ChatMessage) as template input: role and plain-text content.

    Content given as parts is joined from its text parts (newline-separated); any other part (image, audio)
    is refused with the parameter path that carried it, because this engine reads text only.
    """
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        content = msg.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        else:
            pieces = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise unsupported_param(f"messages[{i}].content[{j}].type", part.type,
                                            "only text content parts are supported")
                if part.text is None:
                    raise invalid_param(f"messages[{i}].content[{j}].text", None, "a text part needs its text")
                pieces.append(part.text)
            text = "\n".join(pieces)
        for key, value in (msg.model_extra or {}).items():
            if value not in (None, [], {}, ""):
                raise unsupported_param(f"messages[{i}].{key}", value, "this server renders role, content and "
                                                                      "name only")
        entry: dict[str, Any] = {"role": msg.role, "content": text}
        if msg.name:
            entry["name"] = msg.name
        out.append(entry)
    return out


async def chat_prompt_ids(client: EngineClient, messages: list[Any]) -> list[int]:
    """Token ids of the rendered chat prompt. A template that rejects the messages (its `raise_exception`,
    or a jinja error) is a 400 carrying the template's own message, not a 500."""
    normalized = normalize_messages(messages)
    try:
        return await asyncio.to_thread(client.apply_chat_template, normalized)
    except (ValueError, TypeError, LookupError) as exc:
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages",
                       code="chat_template_error") from None
    except Exception as exc:  # jinja2.TemplateError and friends, without importing jinja2 here
        if type(exc).__module__.startswith("jinja2"):
            raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages",
                           code="chat_template_error") from None
        raise

"""Tokenizer: tokenizer.json through the `tokenizers` library, the chat template, and incremental decoding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.errors import CheckpointError, PromptTooLong
from engine.model.byte_decoder import ByteLevelDecoder, byte_table
from engine.model.prompt_heads import refuse_from_heads

# Used when tokenizer_config.json has no chat_template: ChatML, which Qwen checkpoints use.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as {"content": ...} objects
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """encode / decode / apply_chat_template over a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None = None, special: dict | None = None) -> None:
        self._tok = tokenizer
        self._plain: HFTokenizer | None = None  # encodes special tokens' text as text (encode)
        # each id's bytes (byte-level BPE; None for another decoder), built with the tokenizer, not at a first request
        self._bytes = byte_table(tokenizer)
        self.chat_template = chat_template or CHATML_TEMPLATE
        self.special = special or {}
        self._template = None
        eos = _token_text(self.special.get("eos_token"))
        self.eos_token_id = tokenizer.token_to_id(eos) if eos else None
        bos = _token_text(self.special.get("bos_token"))
        self.bos_token = bos

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        """Read tokenizer.json (required) and tokenizer_config.json (optional: chat template, special tokens)."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(str(path), "missing: a tokenizer.json is needed to encode prompts")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises a plain Exception for a malformed file
            raise CheckpointError(str(path), f"cannot load tokenizer: {exc}") from None
        config: dict = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (OSError, ValueError) as exc:
                raise CheckpointError(str(config_path), f"cannot read JSON: {exc}") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # a list of named templates: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_path = directory / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        return cls(tok, template, config)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (may be below the model's vocab_size)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token string, or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True, specials_in_text: bool = True,
               max_tokens: int | None = None) -> list[int]:
        """Text -> ids; special tokens per tokenizer.json's post-processor (a BOS for Llama, none for Qwen).
        `specials_in_text=False`: a special token's text typed in `text` (`<|endoftext|>`) is encoded as
        plain text, as OpenAI and vLLM encode a user's prompt; a rendered chat template keeps them special.
        `max_tokens`: more ids than that raise PromptTooLong, counted before the id list is built; a text far
        past it is refused for what a head of it holds (engine.model.prompt_heads), the rest never encoded.

        Through `encode_batch`, which releases the GIL while it works (`encode` holds it: a 7 MB prompt
        encoded in a server worker thread stalled the event loop for 4 s). Building the Python list of ids
        holds the GIL for as long as the list is long, so a prompt past the context is refused on its count."""
        tok = self._tok if specials_in_text else self._plain_text_tokenizer()
        if max_tokens is not None:
            refuse_from_heads(lambda head: len(tok.encode_batch([head], add_special_tokens=add_special_tokens)[0]),
                              text, max_tokens)
        encoding = tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if max_tokens is not None and len(encoding) > max_tokens:
            raise PromptTooLong(len(encoding), max_tokens)
        return encoding.ids

    def _plain_text_tokenizer(self) -> HFTokenizer:
        # A second tokenizer, not a toggle of the flag on the shared one: server threads encode concurrently.
        if self._plain is None:
            plain = HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text; ids the tokenizer does not know are dropped."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render the chat template (jinja2, sandboxed) to the prompt text."""
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # The same environment Hugging Face renders chat templates in, so their templates work unchanged.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=_token_text(self.special.get("eos_token")) or "",
        )

    def incremental_decoder(self) -> "IncrementalDecoder | ByteLevelDecoder":
        """A fresh incremental decoder for one stream of generated ids: a byte-level BPE tokenizer's table of
        each id's bytes (engine.model.byte_decoder), else the general window decoder."""
        return ByteLevelDecoder(self._bytes) if self._bytes is not None else IncrementalDecoder(self)


_MAX_PARTIAL_IDS = 3


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    import json

    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


class IncrementalDecoder:
    """Turns a growing id list into text increments, holding back bytes that do not yet form a character.

    Decoding a short window (the last few ids) instead of everything keeps each step O(window); byte-level BPE
    may split a character across ids, which shows up as a trailing U+FFFD until the rest arrives.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, new_ids: list[int]) -> str:
        """Add ids; return the text they complete (may be empty)."""
        self.ids.extend(new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset])
        full_text = self.tokenizer.decode(self.ids[self._prefix_offset:])
        # An unfinished UTF-8 character spans at most 3 bytes, so at most 3 ids: more pending ids than that
        # means the bytes are simply invalid (a random model), and holding them back would never end.
        pending_ids = len(self.ids) - self._read_offset
        complete = not full_text.endswith("\ufffd") or pending_ids > _MAX_PARTIAL_IDS
        if len(full_text) > len(prefix_text) and complete:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end of generation)."""
        prefix_text = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset])
        full_text = self.tokenizer.decode(self.ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self.ids)
        return full_text[len(prefix_text):]

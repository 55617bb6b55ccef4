"""Errors that cross layer boundaries. Torch-free: the server, CLI and TUI map them to messages and codes.

Each error carries the values that make it actionable (parameter and value, file and tensor, the numbers
that did not fit), so whoever catches it can print one clear line instead of a traceback.
"""

from __future__ import annotations


class StrataError(Exception):
    """Base of every error Strata raises on purpose."""


class ConfigError(StrataError, ValueError):
    """An option has a value it cannot take."""

    def __init__(self, param: str, value: object, reason: str) -> None:
        self.param = param
        self.value = value
        self.reason = reason
        super().__init__(f"{param}={value!r}: {reason}")


class CheckpointError(StrataError):
    """A model directory is not a loadable checkpoint: names the file (or tensor) and what was expected."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


class RequestRejected(StrataError):
    """A request that cannot be served as asked; `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        self.message = message
        self.param = param
        self.code = code
        super().__init__(message)


class PromptTooLong(RequestRejected):
    """`at_least`: only part of the prompt was counted (a text far past the context), so `prompt_tokens` is
    a lower bound."""

    def __init__(self, prompt_tokens: int, context_tokens: int, at_least: bool = False) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens
        self.at_least = at_least
        super().__init__(
            f"prompt is {'at least ' if at_least else ''}{prompt_tokens} tokens; "
            f"this engine's context is {context_tokens} tokens",
            param="prompt",
            code="context_length_exceeded",
        )


class MaxTokensTooLarge(RequestRejected):
    def __init__(self, max_tokens: int, prompt_tokens: int, context_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens
        left = context_tokens - prompt_tokens
        super().__init__(
            f"max_tokens={max_tokens} but only {left} tokens are left after a {prompt_tokens}-token prompt "
            f"in a {context_tokens}-token context",
            param="max_tokens",
            code="context_length_exceeded",
        )


class QueueFull(StrataError):
    """The bounded request queue is full; the caller should retry after `retry_after_s`."""

    def __init__(self, queued: int, limit: int, retry_after_s: float = 1.0) -> None:
        self.queued = queued
        self.limit = limit
        self.retry_after_s = retry_after_s
        super().__init__(f"request queue is full ({queued}/{limit} waiting); retry after {retry_after_s:g} s")


class EngineDead(StrataError):
    """The engine stopped (a sticky CUDA error, a crash): no request can be served until a restart."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"engine is dead: {reason}")


class SwitchNeedsRestart(StrataError):
    """A switch that is read only at start was asked to change live."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"switch {name} is read at start: set STRATA_{name} and restart the engine to apply it")


class NoExpertCache(StrataError):
    """A request about the MoE expert cache to an engine whose model has no routed experts (a dense model)."""


class UnknownSwitch(StrataError, KeyError):
    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        super().__init__(f"unknown switch {name!r}; known switches: {', '.join(known)}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]

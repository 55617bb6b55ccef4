"""The shapes of the load scenarios (engine/loadgen/scenarios.py): a scenario and its parameters, the progress it
reports and the result it returns. Torch-free, like the scenarios."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from engine.loadgen.load_client import RequestResult
from engine.errors import ConfigError


@dataclass(frozen=True)
class ScenarioParam:
    """One tunable number of a scenario (CLI: `--set NAME=VALUE`; TUI: a form field)."""

    name: str
    default: int | float
    help: str
    maximum: int | float | None = None  # None: no upper bound (a 0/1 switch has 1)

    def coerce(self, scenario: str, value: Any) -> int | float:
        """Turn a CLI/TUI value into this parameter's type; errors name the parameter and the value."""
        want_int = isinstance(self.default, int)
        try:
            if isinstance(value, bool):
                raise ValueError
            number = int(value) if want_int and not isinstance(value, float) else float(value)
        except (TypeError, ValueError):
            kind = "a whole number" if want_int else "a number"
            raise ConfigError(self.name, value, f"scenario {scenario!r} expects {kind}") from None
        if number < 0:
            raise ConfigError(self.name, value, f"scenario {scenario!r} expects a value >= 0")
        if self.maximum is not None and number > self.maximum:
            raise ConfigError(self.name, value, f"scenario {scenario!r} expects a value <= {self.maximum}")
        return number


@dataclass(frozen=True)
class Scenario:
    """A named load pattern: its parameters and the coroutine that plays it."""

    name: str
    description: str
    params: tuple[ScenarioParam, ...]
    play: Callable[[Any, dict[str, Any]], Awaitable[None]] = field(repr=False)  # (the scenarios' run, params)

    def resolve(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """Defaults with `overrides` applied; an unknown name is a ConfigError listing the known ones."""
        by_name = {p.name: p for p in self.params}
        values: dict[str, Any] = {p.name: p.default for p in self.params}
        for key, value in overrides.items():
            if key not in by_name:
                known = ", ".join(by_name)
                raise ConfigError(key, value, f"not a parameter of scenario {self.name!r}; known: {known}")
            values[key] = by_name[key].coerce(self.name, value)
        return values


@dataclass(frozen=True)
class ScenarioProgress:
    """One step of a running scenario, for a progress line or a log pane.

    `event`: start, sent, first_token, finished, failed, note, done.
    """

    scenario: str
    event: str
    message: str
    elapsed_s: float
    label: str | None = None
    requests_done: int = 0
    requests_total: int = 0


@dataclass
class ScenarioResult:
    """What a scenario did: every request's figures, the server's health before and after, derived metrics."""

    name: str
    base_url: str
    model: str
    params: dict[str, Any]
    started_at: float
    wall_s: float = 0.0
    requests: list[RequestResult] = field(default_factory=list)
    health_before: str = ""
    health_after: str = ""
    metrics: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[str]:
        return [f"{r.label}: {r.error}" for r in self.requests if r.error]

    @property
    def ok(self) -> bool:
        """Every request completed and the server still answers /health with 200."""
        return not self.errors and self.health_after.startswith("200")

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.name,
            "base_url": self.base_url,
            "model": self.model,
            "params": dict(self.params),
            "started_at": self.started_at,
            "wall_s": round(self.wall_s, 4),
            "ok": self.ok,
            "errors": self.errors,
            "health_before": self.health_before,
            "health_after": self.health_after,
            "metrics": dict(self.metrics),
            "notes": list(self.notes),
            "requests": [r.to_json() for r in self.requests],
        }

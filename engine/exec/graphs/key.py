"""What a captured graph is keyed by: its shape bucket and the live switches its captured code depends on.

A graph captured with SPLIT_ATTN on runs the split-KV attention; when the switch is toggled live or
degraded, exactly the graphs that depend on it must go. The key says so itself (`depends_on`), so a
second live switch that changes captured code needs no code that knows the first one by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from engine.switches import get_switch


@dataclass(frozen=True)
class GraphKey:
    shape: tuple[str, ...]  # the bucket: "b8" batch rows, "t64" chunk tokens, "L4096" key span, "k2" drafts, ...
    switches: frozenset[str] = frozenset()  # live switches whose state changed the captured code path

    @classmethod
    def of(cls, *shape: str, switches: Iterable[str] = ()) -> "GraphKey":
        return cls(tuple(shape), frozenset(switches))

    @property
    def runs_chunks(self) -> bool:
        """A step whose forward runs prompt chunks (its bucket has a chunk length, "t64"): the only steps a
        switch of the chunk path changes."""
        return any(part.startswith("t") for part in self.shape)

    def depends_on(self, switch: str) -> bool:
        return switch in self.switches

    def with_switch(self, switch: str) -> "GraphKey":
        return GraphKey(self.shape, self.switches | {switch})

    def responsible_switch(self, never: frozenset[str] = frozenset()) -> str | None:
        """The switch to degrade when this graph cannot be captured, leaving out those in `never` (the first by
        name when there are several: degrading it drops this key, and the next capture tries without it)."""
        blamable = self.switches - never
        return min(blamable) if blamable else None

    def __str__(self) -> str:
        return "(" + ", ".join(self.shape + tuple(get_switch(s).tag for s in sorted(self.switches))) + ")"

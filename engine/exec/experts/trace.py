"""Routing traces and the slot policies they are replayed against. Pure Python (no torch): the live expert
cache (engine.exec.experts.cache) runs the very same `SlotPolicy` code, so a trace replayed offline with the
same slot count gives the live hit and miss counts exactly.

An *access* is one sparse layer's call in one step: the sorted distinct experts that the step's real tokens
were routed to. The cache serves an access in *groups* of at most `slots` experts (ascending ids; a layer
whose access is larger than its pool streams through it group by group): the group's resident experts are
hits, the others are loaded, evicting residents outside the group.

Trace file (JSON lines, `write_trace` / `read_trace`; docs/MODEL.md, "Routing traces"):

    {"format": "strata-expert-trace", "version": 1, "num_layers": 24, "num_experts": 64, "top_k": 8,
     "expert_mib": 0.75, "model": "..."}                                   # header, first line
    {"step": 17, "kind": "decode", "layer": 3, "experts": [2, 9, 40], "tokens": 1}   # one line per access
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

TRACE_FORMAT = "strata-expert-trace"
TRACE_VERSION = 1
POLICIES = ("lru", "lfu", "belady")
LIVE_POLICIES = ("lru", "lfu")  # what the live cache can run (Belady needs the future)
# LRFU's half-life, in groups the layer served: measured against LRU and Belady in docs/BENCHMARKS.md
DEFAULT_HALF_LIFE_GROUPS = 64.0
MIN_HALF_LIFE_GROUPS = 0.01


@dataclass(frozen=True)
class Access:
    """One sparse layer's routed experts in one step."""

    step: int
    layer: int
    experts: tuple[int, ...]
    tokens: int = 0
    kind: str = ""


@dataclass
class GroupResult:
    """What serving one group did: hits, the (expert, slot) loads, and the experts evicted for them."""

    hits: int = 0
    loads: list[tuple[int, int]] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)


def groups_of(experts: Iterable[int], slots: int) -> list[list[int]]:
    """The groups an access is served in: ascending ids, chunks of at most `slots`."""
    ordered = sorted(set(experts))
    size = max(1, slots)
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


class SlotPolicy:
    """Which expert sits in which of `slots` slots; least recently used eviction (override `victim`)."""

    name = "lru"

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.where: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self.free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    def resident(self, expert: int) -> bool:
        return expert in self.where

    def victim(self, group: set[int]) -> int:
        """The resident expert to evict (never one in `group`)."""
        return next(e for e in self.where if e not in group)

    def serve(self, group: list[int]) -> GroupResult:
        """Touch the group's residents, load the rest (evicting outside the group); len(group) <= slots."""
        assert len(group) <= self.slots, f"group of {len(group)} experts for {self.slots} slots"
        result = GroupResult()
        members = set(group)
        for e in group:
            if e in self.where:
                result.hits += 1
                self.where.move_to_end(e)
        for e in group:
            if e in self.where:
                continue
            if self.free:
                slot = self.free.pop()
            else:
                old = self.victim(members)
                slot = self.where.pop(old)
                result.evicted.append(old)
            self.where[e] = slot
            result.loads.append((e, slot))
        return result

    def ranked(self) -> list[int]:
        """The residents, least worth keeping first (LRU: least recently used first)."""
        return list(self.where)

    def resize(self, slots: int) -> dict[int, int]:
        """Keep the `slots` residents most worth keeping (`ranked`) in slots 0.., in their recency order; returns
        {expert: its old slot} of those kept (the caller copies them to their new slots, `self.where`)."""
        keep = set(self.ranked()[-slots:]) if slots > 0 else set()
        kept = [(e, s) for e, s in self.where.items() if e in keep]
        self.slots = slots
        self.where = OrderedDict((e, new) for new, (e, _) in enumerate(kept))
        self.free = list(range(slots - 1, len(kept) - 1, -1))
        return {e: old for e, old in kept}


class FrequencyPolicy(SlotPolicy):
    """LRFU (Lee et al., 1999): evicts the resident with the smallest exponentially decayed use count. Every
    expert of a group adds 1 to its count; counts halve every `half_life` groups this layer serves, and
    experts that are not resident keep theirs (a history of E numbers per layer), so an expert that comes back
    is weighed by its past. A short half-life behaves like LRU, a long one like LFU; ties go to the least
    recently used."""

    name = "lfu"

    def __init__(self, slots: int, half_life: float = DEFAULT_HALF_LIFE_GROUPS) -> None:
        if not half_life >= MIN_HALF_LIFE_GROUPS:  # shorter: the per-group weight growth overflows a float
            raise ValueError(f"half_life={half_life}: expected at least {MIN_HALF_LIFE_GROUPS} groups")
        super().__init__(slots)
        self.half_life = half_life
        self.score: dict[int, float] = {}  # decayed count x 2 ** (now / half_life): one add per use, no decay loop
        self._unit = 1.0
        self._growth = 2.0 ** (1.0 / half_life)

    def victim(self, group: set[int]) -> int:
        return min((e for e in self.where if e not in group), key=lambda e: self.score.get(e, 0.0))

    def ranked(self) -> list[int]:
        return sorted(self.where, key=lambda e: self.score.get(e, 0.0))  # stable: recency among equals

    def serve(self, group: list[int]) -> GroupResult:
        for e in group:
            self.score[e] = self.score.get(e, 0.0) + self._unit
        result = super().serve(group)
        self._unit *= self._growth
        if self._unit > 1e100:  # rescale before the floats overflow; the order is unchanged
            self.score = {e: v / self._unit for e, v in self.score.items()}
            self._unit = 1.0
        return result


def make_policy(name: str, slots: int, half_life: float = DEFAULT_HALF_LIFE_GROUPS) -> SlotPolicy:
    """A live policy by name (`lru` or `lfu`)."""
    if name == "lru":
        return SlotPolicy(slots)
    if name == "lfu":
        return FrequencyPolicy(slots, half_life)
    raise ValueError(f"policy={name!r}: expected one of {', '.join(LIVE_POLICIES)}")


def adopt(policy: SlotPolicy, name: str) -> SlotPolicy:
    """`policy`'s residents (same slots, same recency order) under the policy `name`: a live switch of policy
    moves no expert. A frequency policy starts with no history (its ties fall back to recency)."""
    if policy.name == name:
        return policy
    new = make_policy(name, policy.slots)
    new.where = OrderedDict(policy.where)
    new.free = list(policy.free)
    return new


class BeladyPolicy(SlotPolicy):
    """Evicts the resident expert whose next use is furthest in the future (the offline optimum for single
    loads; with groups, the greedy furthest-next-use rule). Needs the whole access sequence up front."""

    name = "belady"

    def __init__(self, slots: int, sequence: list[list[int]]) -> None:
        super().__init__(slots)
        self.uses: dict[int, list[int]] = {}
        for t, group in enumerate(sequence):
            for e in group:
                self.uses.setdefault(e, []).append(t)
        self.now = 0

    def victim(self, group: set[int]) -> int:
        def next_use(e: int) -> float:
            uses = self.uses.get(e, [])
            i = bisect.bisect_right(uses, self.now)
            return uses[i] if i < len(uses) else float("inf")

        return max((e for e in self.where if e not in group), key=next_use)

    def serve(self, group: list[int]) -> GroupResult:
        result = super().serve(group)
        self.now += 1
        return result


def replay(accesses: Iterable[Access], slots: int | dict[int, int], policy: str = "lru",
           half_life: float = DEFAULT_HALF_LIFE_GROUPS) -> dict[int, tuple[int, int]]:
    """{layer: (hits, misses)} of serving `accesses` with `slots` per layer (an int, or per layer)."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}: expected one of {', '.join(POLICIES)}")
    by_layer: dict[int, list[Access]] = {}
    for a in accesses:
        by_layer.setdefault(a.layer, []).append(a)
    out: dict[int, tuple[int, int]] = {}
    for layer, seq in by_layer.items():
        n = slots[layer] if isinstance(slots, dict) else slots
        groups = [g for a in seq for g in groups_of(a.experts, n)]
        pol = BeladyPolicy(n, groups) if policy == "belady" else make_policy(policy, n, half_life)
        hits = misses = 0
        for g in groups:
            r = pol.serve(g)
            hits += r.hits
            misses += len(r.loads)
        out[layer] = (hits, misses)
    return out


def hit_rate(result: dict[int, tuple[int, int]]) -> float | None:
    """Overall hits / accesses of a replay result (None when nothing was accessed)."""
    hits = sum(h for h, _ in result.values())
    total = hits + sum(m for _, m in result.values())
    return hits / total if total else None


def write_trace(path: str | Path, header: dict, accesses: Iterable[Access]) -> Path:
    """Write a trace file: the header line, then one line per access."""
    path = Path(path)
    with path.open("w") as fh:
        fh.write(json.dumps({"format": TRACE_FORMAT, "version": TRACE_VERSION, **header}) + "\n")
        for a in accesses:
            fh.write(json.dumps({"step": a.step, "kind": a.kind, "layer": a.layer, "experts": list(a.experts),
                                 "tokens": a.tokens}) + "\n")
    return path


def read_trace(path: str | Path) -> tuple[dict, list[Access]]:
    """(header, accesses) of a trace file; a file that is not one raises ValueError naming the line."""
    path = Path(path)
    lines = path.read_text().splitlines()
    if not lines:
        raise ValueError(f"{path}: empty, not a {TRACE_FORMAT} file")
    header = json.loads(lines[0])
    if header.get("format") != TRACE_FORMAT or header.get("version") != TRACE_VERSION:
        raise ValueError(f"{path}:1: expected a {TRACE_FORMAT} version {TRACE_VERSION} header")
    return header, list(_accesses(path, lines[1:]))


def _accesses(path: Path, lines: list[str]) -> Iterator[Access]:
    for n, line in enumerate(lines, start=2):
        try:
            d = json.loads(line)
            yield Access(int(d["step"]), int(d["layer"]), tuple(int(e) for e in d["experts"]), int(d.get("tokens", 0)),
                         str(d.get("kind", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a trace access line: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.exec.experts.trace TRACE --slots 4,8,16`: hit rates of LRU, LFU and Belady per budget."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m engine.exec.experts.trace", description=main.__doc__)
    parser.add_argument("trace", help="a strata-expert-trace JSON-lines file")
    parser.add_argument("--slots", default="4,8,16", help="slots per layer to replay with (comma-separated)")
    args = parser.parse_args(argv)
    try:
        header, accesses = read_trace(args.trace)
        slot_counts = [int(s) for s in args.slots.split(",")]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    print(f"{len(accesses)} accesses, {header.get('num_layers')} layers x {header.get('num_experts')} experts")
    for n in slot_counts:
        rates = {p: hit_rate(replay(accesses, n, p)) for p in POLICIES}
        print(f"slots {n:5d}: " + "  ".join(f"{p} {r if r is None else round(r, 4)}" for p, r in rates.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

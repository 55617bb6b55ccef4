"""Drive the real Engine in-process for the benchmarks: build it from the bench's options, feed it prompts,
step it to completion and time what happened.

No server and no AsyncEngine: the GPU image has no fastapi/httpx, and stepping the Engine on this thread
measures the engine itself. Timing is host wall time around `Engine.step()`, which returns once the step's tokens
are on the host (the next greedy step may be queued by then: engine.exec.decode_ahead), so a span of steps that
ends with its requests' last tokens ends on a device sync.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from engine.api import SamplingParams
from engine.bench.common import device_of, prepare_model
from engine.config import EngineConfig, config_from_args
from engine.errors import StrataError
from engine.exec.step_fns import EagerExecutor
from engine.orchestration.startup_heap import freeze_startup_heap, thaw_heap
from engine.core.request import Request
from engine.telemetry import EventBus


class EngineDied(StrataError):
    """The engine stopped during a benchmark; carries its own health reason (the real error)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"the engine died during the benchmark: {reason}")


@dataclass
class GenerateStats:
    """One batch of requests run to completion."""

    wall_s: float
    tokens: int  # completion tokens of all requests
    steps: int
    ttft_s: list[float]  # per request, from add_request to its first token
    decode_s: float  # from the moment every request had its first token to the end
    decode_tokens: int  # tokens produced in that span
    decode_steps: int  # engine steps in that span
    batch: int
    proposed: list[int] = field(default_factory=list)  # MTP drafts proposed per draft position, all requests
    accepted: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)  # what each request generated
    cached_tokens: list[int] = field(default_factory=list)  # per request: prompt tokens whose KV came from the tier

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens else None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens each decoding slot gained per decode step (1 without MTP; slots that finished early make
        the last steps' batches smaller, so this is a lower bound for uneven finishes)."""
        slot_steps = self.decode_steps * self.batch
        return None if not slot_steps else self.decode_tokens / slot_steps

    @property
    def acceptance_per_position(self) -> list[float | None]:
        return [a / p if p else None for p, a in zip(self.proposed, self.accepted)]


class BenchEngine:
    """An Engine plus its bus, built for a benchmark; `executor_wiring` says who set up the graph cache."""

    def __init__(self, config: EngineConfig, graph_cache_on_cpu: bool = False,
                 tier_budget_mib: float | None = None) -> None:
        from engine.orchestration.engine import Engine

        self.config = config
        self.bus = EventBus(history=4096)
        self.engine = Engine(config, self.bus, tier_budget_mib=tier_budget_mib)
        self.executor_wiring = "engine"
        wants_graphs = config.graphs and (self.engine.device.type == "cuda" or graph_cache_on_cpu)
        if wants_graphs and isinstance(self.engine.graphs, EagerExecutor):
            self._wire_graph_cache()
        self._ids = 0
        self.mib_left_after_close: float | None = None
        freeze_startup_heap()  # as `strata-engine serve` does once its engine is ready

    def _wire_graph_cache(self) -> None:
        """Give a CPU engine the graph cache (its CPU backend) the way engine_setup wires it on CUDA, so the
        graph benchmark's code path runs in CI."""
        from engine.exec.graphs.cache import GraphCache
        from engine.exec.runner import switch_for_key

        eng = self.engine
        cache = GraphCache(eng.device, self.bus, eng.board, release_tier=eng.tier.release,
                           wait_polls=self.config.tier_wait_polls, wait_interval_s=self.config.tier_wait_interval_s,
                           switch_for_key=switch_for_key, streams=eng.streams)
        eng.graphs = cache
        eng.runner.graphs = cache
        self.executor_wiring = "bench"

    @property
    def graphs_active(self) -> bool:
        return not isinstance(self.engine.graphs, EagerExecutor)

    def graph_snapshot(self) -> dict[str, Any]:
        """The graph executor's snapshot in its JSON form, as the reports write it."""
        return self.engine.graphs.snapshot().to_json()

    def add(self, prompt: list[int], max_tokens: int) -> Request:
        """Queue one greedy request that generates exactly `max_tokens` (EOS ignored)."""
        self._ids += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return self.engine.add_request(f"bench-{self._ids}", prompt, params)

    def step(self) -> list[Any]:
        """One engine step; raises EngineDied (with the engine's reason) if the step killed it."""
        outputs = self.engine.step()
        health = self.engine.health()
        if not health.ready:
            raise EngineDied(health.reason)
        return outputs

    def close(self) -> None:
        """Free the engine's device memory so the next configuration of one run starts from a clean device;
        `mib_left_after_close` is what this process still holds allocated on it (a leak shows there)."""
        import gc

        import torch

        device = self.engine.device
        thaw_heap()  # the engine's cycles (frozen at start) within the collector's reach again
        self.engine.close()  # frees the graphs, tier, KV and weights and empties the CUDA cache
        del self.engine
        gc.collect()  # what else the engine held (runner buffers) goes with it
        if device.type == "cuda":
            self.mib_left_after_close = torch.cuda.memory_allocated(device) / float(1 << 20)


class StepLog:
    """Every StepTiming the engine hands its scheduler while installed (the pacer's own measurements: each chunk,
    the decode part and the cache fills, each ending on a device sync): where a stretch of steps spent its time."""

    def __init__(self, bench: BenchEngine) -> None:
        self.sched = bench.engine.sched
        self.timings: list[Any] = []
        self._record = self.sched.record_step

    def __enter__(self) -> "StepLog":
        def record(timing: Any) -> None:
            self.timings.append(timing)
            self._record(timing)

        self.sched.record_step = record
        return self

    def __exit__(self, *_exc: Any) -> None:
        del self.sched.record_step  # the bound method again

    def summary(self) -> dict[str, Any]:
        """Where the steps' time went: chunks (how many, how big, how long; with those beside the steps apart),
        decode, cache fills (`during_*`: the admission bench's names; a stretch of steps of any bench)."""
        chunks = [c for t in self.timings for c in t.prefill + t.landed]
        sizes = [c.num_tokens for c in chunks]
        beside = [c for t in self.timings for c in t.landed]
        return {
            "during_chunks": len(chunks), "during_chunk_tokens": sum(sizes),
            "during_chunk_s": sum(c.seconds for c in chunks),
            # chunks beside the steps (engine.exec.chunk_stream): their device time overlaps the decode time
            "during_chunks_beside": len(beside), "during_chunk_beside_s": sum(c.seconds for c in beside),
            "during_decode_s": sum(t.decode_s or 0.0 for t in self.timings),
            "during_decode_beside_s": sum(t.decode_s or 0.0 for t in self.timings if t.beside_chunk),
            "during_fill_s": sum(t.other_prefill_s for t in self.timings),
            "during_steps_with_chunk": sum(1 for t in self.timings if t.prefill or t.beside_chunk),
            "chunk_tokens_min": min(sizes, default=None),
            "chunk_tokens_p50": statistics.median(sizes) if sizes else None,
            "chunk_tokens_max": max(sizes, default=None),
            "chunk_ms_max": max((c.seconds for c in chunks), default=0.0) * 1e3 if chunks else None,
        }


def build_engine(args: argparse.Namespace, graph_cache_on_cpu: bool = False, **overrides: Any) -> BenchEngine:
    """An engine from the bench's model options (switches from the environment), with `overrides` applied
    (`tier_budget_mib`: the tier's size instead of what is free)."""
    tier_budget_mib = overrides.pop("tier_budget_mib", None)
    config = config_from_args(args)
    device = device_of(config.device)
    model = overrides.pop("model", None) or prepare_model(config.model, device, config.dtype)
    switches = {**config.switches, **overrides.pop("switches", {})}
    config = dataclasses.replace(config, model=model, device=str(device), switches=switches, **overrides)
    return BenchEngine(config, graph_cache_on_cpu=graph_cache_on_cpu, tier_budget_mib=tier_budget_mib)


def generate_all(bench: BenchEngine, prompts: list[list[int]], max_tokens: int) -> GenerateStats:
    """Add every prompt at once, step until all finish; time-to-first-token and steady decode are split."""
    start = time.perf_counter()
    reqs = [bench.add(p, max_tokens) for p in prompts]
    steps = 0
    first_token_s: dict[str, float] = {}
    all_first_s: float | None = None
    tokens_at_all_first = 0
    steps_at_all_first = 0
    # Every step computes at least one prompt or output token of some request; more steps than that is a hang.
    max_steps = sum(len(p) for p in prompts) + max_tokens * len(prompts) + 100
    while any(not r.is_finished for r in reqs):
        bench.step()
        steps += 1
        if steps > max_steps:
            raise EngineDied(f"no progress: {steps} steps for {len(prompts)} requests of {max_tokens} tokens")
        now = time.perf_counter()
        for r in reqs:
            if r.request_id not in first_token_s and r.num_output_tokens:
                first_token_s[r.request_id] = now - start
        if all_first_s is None and len(first_token_s) == len(reqs):
            all_first_s = now
            tokens_at_all_first = sum(r.num_output_tokens for r in reqs)
            steps_at_all_first = steps
    end = time.perf_counter()
    tokens = sum(r.num_output_tokens for r in reqs)
    depth = max((len(r.draft_proposed) for r in reqs), default=0)
    proposed = [sum(r.draft_proposed[i] for r in reqs if i < len(r.draft_proposed)) for i in range(depth)]
    accepted = [sum(r.draft_accepted[i] for r in reqs if i < len(r.draft_accepted)) for i in range(depth)]
    decode_steps = steps - steps_at_all_first
    return GenerateStats(
        wall_s=end - start, tokens=tokens, steps=steps, ttft_s=[first_token_s[r.request_id] for r in reqs],
        decode_s=end - (all_first_s or end), decode_tokens=tokens - tokens_at_all_first,
        decode_steps=decode_steps, batch=len(reqs), proposed=proposed, accepted=accepted,
        errors=[f"{r.request_id}: {r.finish_reason}" for r in reqs if r.finish_reason not in ("length", "stop")],
        token_ids=[list(r.output_token_ids) for r in reqs], cached_tokens=[r.num_cached_tokens for r in reqs],
    )

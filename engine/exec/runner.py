"""ModelRunner: the one place where the model, the KV cache, the step executor and the switches meet.

Every forward is a *step function* of static-shape inputs handed to `executor.run(kind, key, fn, inputs)`:
batches are padded to a batch bucket (1, 2, 4, 8, ...), prompt chunks to a token bucket, and the keys a
forward reads to a length bucket (the "span"). Padded rows write only scratch columns past the context
(see engine.exec.kv.cache), so they never disturb a real slot. Nothing inside a step function reads a tensor
value on the host: the graph cache can capture any of them.

When the executor raises GraphDegraded for a step that used an opt-in switch, the switch is degraded (with a
SwitchEvent and a WARNING) and the step is retried on the path without it. A GraphDegraded that names no switch
from a drafting step raises MtpUnavailable, which the engine turns into "MTP off for the rest of the run".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from engine.exec.pinned_stager import PinnedStager
from engine.exec.step_buckets import MIN_CHUNK_TOKENS, StepBuckets, pow2_bucket
from engine.exec.step_fns import EagerExecutor, GraphDegraded, StepExecutor
from engine.exec.graphs.key import GraphKey
from engine.exec.graphs.cache import GraphSpec
from engine.exec.gpu_errors import is_oom, is_sticky, real_message
from engine.exec.kv.cache import SlotKVCache
from engine.exec.sampler import finite_rows, flag_non_finite
from engine.switches import SwitchBoard
from engine.telemetry import EventBus, WarningEvent

# Prompt chunks up to this many tokens replay a captured graph when the prompt-chunk kernel runs them and their
# bucket was seen before (`ModelRunner.graph_chunk_tokens`): an eager forward is bound by the host's launches
# until the chunk's device time outgrows them. Longer chunks stay eager (their graph would hold a long chunk's
# activations in the graph pool); a capture costs a few eager runs, so a bucket seen once stays eager.
GRAPH_CHUNK_TOKENS = 512
# A small dense model (hidden size up to SMALL_HIDDEN) takes chunks up to the default chunk: its lone 1K chunk run
# eagerly cost the prompt pacer's fit several times its device time, and a burst of short prompts beside decoding
# slots then went one prompt a step. Larger and MoE models keep GRAPH_CHUNK_TOKENS (not measured past it).
SMALL_GRAPH_CHUNK_TOKENS = 2048
SMALL_HIDDEN = 2048
SPLIT_SWITCH = "SPLIT_ATTN"
PAGED_SWITCH = "PAGED_ATTN"
PREFILL_SWITCH = "PAGED_PREFILL"
# Never blamed for a graph that cannot be captured: the paged kernels need less memory than the gathering path
# they replace, so degrading them would make an out-of-memory capture worse; their steps fail over like any plain
# step (run eagerly, or MTP off). SPLIT_ATTN is blamed: its scratch grows with the context.
NEVER_BLAMED = frozenset({PAGED_SWITCH, PREFILL_SWITCH})
_DRAFTING_KINDS = ("verify", "draft_prefill", "draft_round", "draft_step", "verify_draft")


def switch_for_key(kind: str, key: Hashable) -> str | None:
    """The opt-in switch to blame when a step's graph cannot be captured (engine.exec.graphs.cache.GraphCache's degrade
    path): one the key depends on, never one of NEVER_BLAMED."""
    return key.responsible_switch(never=NEVER_BLAMED) if isinstance(key, GraphKey) else None


def split_switches(split: bool) -> tuple[str, ...]:
    """The live switches a step built with or without split-KV attention depends on."""
    return (SPLIT_SWITCH,) if split else ()


class MtpUnavailable(RuntimeError):
    """A drafting step could not run (its graph degraded with no switch to blame): turn MTP off."""


@dataclass(frozen=True)
class Row:
    """One decoding slot in a batch: its slot, the token to feed, and that token's position."""

    slot: int
    token: int
    position: int


@dataclass
class StepOutput:
    """What a decode/verify/prefill forward gives back (device tensors, rows padded to the bucket)."""

    logits: torch.Tensor  # [Bb, T, V] (prefill: [1, 1, V], the last real position)
    hidden: torch.Tensor  # [Bb, T, H] after the final norm
    drafts: torch.Tensor | None = None  # verify: [Bb, K] the drafts that were checked
    span_tokens: int = 0
    best: torch.Tensor | None = None  # decode: [Bb, 1] the argmax, in the step's graph (greedy rows read it)
    # decode: [Bb, 1] the argmax, -1 where the row's logits hold NaN or inf (sampler.NO_TOKEN): what the host reads
    # of a step launched ahead, whose `best` feeds the next step as it is (a -1 would be no token id there)
    checked: torch.Tensor | None = None


StepBuilder = Callable[[bool], tuple[Hashable, Callable]]


class ModelRunner(StepBuckets):
    """Runs prefill chunks, batched decode and MTP verify forwards over the slot KV cache."""

    def __init__(self, model: torch.nn.Module, kv: SlotKVCache, graphs: StepExecutor, board: SwitchBoard,
                 bus: EventBus, device: torch.device, num_slots: int, mtp_depth: int = 0, *,
                 eager: StepExecutor | None = None, release_memory: Callable[[float, str], float] | None = None,
                 oom_release_mib: float = 1024.0) -> None:
        """`graphs`: the step executor (the graph cache, or eager). `eager`: the one for prompt chunks that take
        the fused (flash) chunk attention (it bakes the chunk's start into the step, so a graph of it would never
        be replayed, and a chunk's compute dwarfs launch cost) and for chunks beside the steps (`prefill`).
        `release_memory(mib, reason) -> freed`: where an out-of-memory step gets room before its one retry,
        `oom_release_mib` at a time."""
        self.model = model
        self.graph_chunk_tokens = graph_chunk_tokens(model)
        self.kv = kv
        self.graphs = graphs
        self.board = board
        self.bus = bus
        self.device = device
        self.num_slots = num_slots
        self.context_tokens = kv.geometry.context_tokens
        self.pad_start_tokens = kv.geometry.pad_start_tokens  # padded rows write from here (the margin's blocks)
        self.mtp_depth = mtp_depth
        # Drafts waiting for verification, one row per slot plus a scratch row for padded batch rows.
        self.draft_buf = torch.zeros(num_slots + 1, max(1, mtp_depth), dtype=torch.long, device=device)
        self.pad_row = num_slots
        self._stager: PinnedStager | None = None
        self._eager = eager if eager is not None else EagerExecutor()
        self.release_memory = release_memory
        self.oom_release_mib = oom_release_mib
        # Positions a forward may write past its rows' last token (the MTP round and chain steps): mapped with it.
        self.lookahead_tokens = 2 * mtp_depth + 2
        self._chunk_buckets_seen: set[tuple] = set()  # (tokens, span) buckets of short chunks between the steps

    # --- staging and the path -------------------------------------------------------------------------------

    def stage(self, values: list, dtype: torch.dtype = torch.long, pinned: bool = False) -> torch.Tensor:
        """Host values -> device tensor; through a pinned buffer and a non-blocking copy with PINNED_STAGING or
        `pinned` (a step launched ahead: a plain copy waits for the step in flight, engine.exec.decode_ahead)."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        if pinned or self.board.enabled("PINNED_STAGING"):
            if self._stager is None:
                self._stager = PinnedStager(self.device)
            return self._stager.stage(host)
        return host.to(self.device)

    def split_enabled(self) -> bool:
        return self.board.enabled(SPLIT_SWITCH)

    def paged_enabled(self) -> bool:
        """PAGED_ATTN on and its kernels can run here (engine.model.attention.backends.kernel_backend)."""
        return self.kv.kernel is not None and self.board.enabled(PAGED_SWITCH)

    def on_path(self, key: GraphKey, fn: Callable) -> tuple[GraphKey, Callable]:
        """A built step on the current PAGED_ATTN / PAGED_PREFILL path: the key says so (PAGED_PREFILL only for
        steps that run prompt chunks), and the step tells the cache which backend to use before its forward (so
        a replayed graph and an eager run take the same path)."""
        paged, kv = self.paged_enabled(), self.kv
        prefill = paged and key.runs_chunks and self.board.enabled(PREFILL_SWITCH)

        def step(x):
            kv.set_path(kv.split_attn, paged, prefill)
            return fn(x)

        if paged:
            key = key.with_switch(PAGED_SWITCH)
        return (key.with_switch(PREFILL_SWITCH) if prefill else key), step

    # --- the executor seam ---------------------------------------------------------------------------------

    def run(self, kind: str, build: StepBuilder, inputs: dict, owner: str | None = None,
            executor: StepExecutor | None = None) -> dict:
        """Run one step through the executor; degrade a failing switch and retry, or raise MtpUnavailable."""
        while True:
            key, fn = self.on_path(*build(self.split_enabled()))
            try:
                out = self._run_with_room(kind, key, fn, inputs, owner, executor or self.graphs)
                break
            except GraphDegraded as exc:
                if exc.switch is not None and self.board.enabled(exc.switch):
                    self._degrade(exc.switch, exc)
                    continue  # the same step on the path without that switch (each switch degrades once)
                if owner == "drafter" or kind in _DRAFTING_KINDS:
                    raise MtpUnavailable(exc.error) from exc
                # A plain forward lost its graph with no switch to blame: run it eagerly this time.
                self.bus.publish(WarningEvent(where=f"runner.{kind}", message=f"{exc}; running this step eagerly"))
                out = fn(inputs)
                break
        return out

    def _run_with_room(self, kind: str, key: Hashable, fn: Callable, inputs: dict, owner: str | None,
                       executor: StepExecutor) -> dict:
        """executor.run; on an out-of-memory (not a sticky error), ask the tier for room and retry once.

        Safe to repeat: a step function only writes KV at its own positions and returns fresh outputs.
        """
        try:
            return executor.run(kind, key, fn, inputs, owner)
        except GraphDegraded:
            raise
        except Exception as exc:
            if self.release_memory is None or not is_oom(exc) or is_sticky(exc):
                raise
            freed_mib = self.release_memory(self.oom_release_mib, f"{kind} step out of memory")
            self.bus.publish(WarningEvent(where=f"runner.{kind}", message=(
                f"{real_message(exc)}; the tier gave back {freed_mib:.0f} MiB, retrying the step once")))
            if freed_mib <= 0:
                raise
            return executor.run(kind, key, fn, inputs, owner)

    def _degrade(self, name: str, exc: GraphDegraded) -> None:
        self.board.degrade(name, f"{exc.kind} graph {exc.key}: {exc.error}", self.bus, where=f"runner.{exc.kind}")
        self.on_switch_changed(name)

    def on_switch_changed(self, name: str) -> None:
        """A live switch changed: drop the graphs whose captured code depends on it."""
        self.graphs.invalidate(lambda kind, key: isinstance(key, GraphKey) and key.depends_on(name))

    # --- CAPTURE_ALL ---------------------------------------------------------------------------------------

    def pad_positions(self, bb: int, t: int) -> list[list[int]]:
        """Positions [bb, t] of rows that are all padding: scratch columns past the context, never a token."""
        return [[self.pad_start_tokens + j for j in range(t)] for _ in range(bb)]

    def graph_specs(self, verify: bool = True) -> list[GraphSpec]:
        """CAPTURE_ALL: a GraphSpec for every decode bucket (batch x length), or every verify bucket (with
        1 + depth tokens per row) when MTP drafts and `verify` (False: the drafter's fused step verifies), on
        the current SPLIT_ATTN path. The inputs are all padding rows (slot 0's scratch columns, the draft
        buffer's scratch row), so the warm-up a capture executes writes no real KV."""
        specs = []
        split = self.split_enabled()
        if self.mtp_depth and not verify:
            return specs
        for bb in self.batch_buckets():
            slots, zeros = [0] * bb, [0] * bb
            for span in self.step_spans():
                if self.mtp_depth:
                    inputs = self.verify_inputs(slots, [self.pad_row] * bb, zeros,
                                                 self.pad_positions(bb, self.mtp_depth + 1))
                    key, fn = self.on_path(*self.verify_build(bb, span)(split))
                    specs.append(GraphSpec("verify", key, fn, inputs))
                else:
                    inputs = self._decode_inputs(slots, zeros, self.pad_positions(bb, 1))
                    key, fn = self.on_path(*self._decode_build(bb, span)(split))
                    specs.append(GraphSpec("decode", key, fn, inputs))
        return specs

    # --- forwards ------------------------------------------------------------------------------------------

    def pad_rows(self, rows: list[Row], t: int) -> tuple[list[int], list[list[int]]]:
        """Slots and positions [Bb, t] of a batch; padded rows write scratch columns past the context."""
        bb = self.batch_bucket(len(rows))
        self.kv.prepare({r.slot: r.position + t + self.lookahead_tokens for r in rows})
        slots = [r.slot for r in rows] + [0] * (bb - len(rows))
        positions = [[r.position + j for j in range(t)] for r in rows]
        positions += [[self.pad_start_tokens + j for j in range(t)]] * (bb - len(rows))
        return slots, positions

    def decode(self, rows: list[Row], tokens: torch.Tensor | None = None) -> StepOutput:
        """One token for each row: logits [Bb, 1, V] and hidden [Bb, 1, H]. `tokens`: the rows' tokens on the
        device ([>= rows, 1], a step's argmax: engine.exec.decode_ahead), in place of each Row's token."""
        slots, positions = self.pad_rows(rows, 1)
        bb = len(slots)
        span = self.step_span(max(r.position for r in rows) + 1)
        inputs = self._decode_inputs(slots, [r.token for r in rows] + [0] * (bb - len(rows)), positions,
                                     pinned=tokens is not None)
        if tokens is not None:
            inputs["tokens"][:len(rows)].copy_(tokens[:len(rows)])  # a device copy, queued before the step
        out = self.run("decode", self._decode_build(bb, span), inputs)
        return StepOutput(out["logits"], out["hidden"], span_tokens=span, best=out["best"], checked=out["checked"])

    def _decode_inputs(self, slots: list[int], tokens: list[int], positions: list[list[int]],
                       pinned: bool = False) -> dict:
        bb = len(slots)
        # One host-to-device copy for all inputs: [3, Bb] split into views.
        packed = self.stage([slots, tokens, [p[0] for p in positions]], pinned=pinned)
        return {"slots": packed[0], "tokens": packed[1].view(bb, 1), "positions": packed[2].view(bb, 1)}

    def _decode_build(self, bb: int, span: int) -> StepBuilder:
        def build(split: bool):
            key = GraphKey.of(f"b{bb}", f"L{span}", switches=split_switches(split))
            forward = self._forward_fn(span, split)

            def decode_fn(x):
                # the greedy token inside the replay: outside it, the argmax is one more launch and its host
                # time on every step (a sampled row leaves it unread); with the finite check beside it, so a
                # step whose tokens are read without the sampler (engine.exec.decode_ahead) is checked too, in
                # the copy the host makes anyway
                out = forward(x)
                best = out["logits"].argmax(dim=-1)  # [Bb, 1]
                return {**out, "best": best, "checked": flag_non_finite(best, finite_rows(out["logits"]))}

            return key, decode_fn

        return build

    def verify(self, rows: list[Row]) -> StepOutput:
        """Each row's pending token plus its K drafts (from draft_buf) in one forward: logits [Bb, K+1, V]."""
        k = self.mtp_depth
        slots, positions = self.pad_rows(rows, k + 1)
        bb = len(slots)
        span = self.step_span(max(r.position for r in rows) + k + 1)
        draft_rows = [r.slot for r in rows] + [self.pad_row] * (bb - len(rows))
        pending = [r.token for r in rows] + [0] * (bb - len(rows))
        inputs = self.verify_inputs(slots, draft_rows, pending, positions)
        out = self.run("verify", self.verify_build(bb, span), inputs)
        return StepOutput(out["logits"], out["hidden"], out["drafts"], span_tokens=span)

    def verify_inputs(self, slots: list[int], draft_rows: list[int], pending: list[int],
                      positions: list[list[int]]) -> dict:
        packed = self.stage([[s, d, p] + pos for s, d, p, pos in zip(slots, draft_rows, pending, positions)])
        return {"slots": packed[:, 0], "draft_rows": packed[:, 1], "pending": packed[:, 2:3],
                "positions": packed[:, 3:]}

    def verify_build(self, bb: int, span: int) -> StepBuilder:
        k, draft_buf = self.mtp_depth, self.draft_buf

        def build(split: bool):
            forward = self._forward_fn(span, split)

            def verify_fn(x):
                drafts = draft_buf.index_select(0, x["draft_rows"])[:, :k]  # [Bb, K]
                out = forward({"slots": x["slots"], "tokens": torch.cat([x["pending"], drafts], 1),
                               "positions": x["positions"]})
                out["drafts"] = drafts
                return out

            key = GraphKey.of(f"b{bb}", f"k{k}", f"L{span}", switches=split_switches(split))
            return key, verify_fn

        return build

    def prefill(self, slot: int, token_ids: list[int], start: int, beside: bool = False) -> StepOutput:
        """Prompt tokens at positions [start, start+n) of one slot: last position's logits, all hidden states.
        `beside`: the chunk runs on the side stream beside the steps (engine.exec.chunk_stream), always eagerly:
        bursts of mixed prompts came out with NaN logits whenever chunks beside the steps replayed captured graphs
        there, under either KV pool, and never with those chunks eager (docs/SCHEDULING.md). A chunk between the
        steps replays graphs captured for its bucket, in the steps' pool."""
        n = len(token_ids)
        self.kv.prepare({slot: start + n + self.lookahead_tokens})
        tb = pow2_bucket(n, MIN_CHUNK_TOKENS)
        span = self.chunk_span(start + n)
        positions = [start + j for j in range(n)] + [self.pad_start_tokens + j for j in range(tb - n)]
        inputs = {"slots": self.stage([slot]), "tokens": self.stage([list(token_ids) + [0] * (tb - n)]),
                  "positions": self.stage([positions]), "last": self.stage([n - 1])}

        # The prompt-chunk kernel (PAGED_PREFILL) applies the causal rule by position, so a chunk it runs needs no
        # `start` baked in: a short one is keyed like the drafter's prefill and replays a captured graph.
        graph_chunk = tb <= self.graph_chunk_tokens and self.paged_enabled() and self.board.enabled(PREFILL_SWITCH)
        fused = not graph_chunk and self.kv.chunk_fusable(self.model.config.num_attention_heads, tb)
        eager = beside or fused or (graph_chunk and (tb, span) not in self._chunk_buckets_seen)
        if graph_chunk and not beside:
            self._chunk_buckets_seen.add((tb, span))

        def build(split: bool):
            if fused:  # the fused chunk attention bakes `start` in (SlotKVCache.bind_chunk): eager, keyed by it
                key = GraphKey.of(f"t{tb}", f"L{span}", f"s{start}", switches=split_switches(split))
                return key, self._forward_fn(span, split, last_only=True, chunk=(start, tb))
            key = GraphKey.of(f"t{tb}", f"L{span}", switches=split_switches(split))
            return key, self._forward_fn(span, split, True)

        out = self.run("prefill", build, inputs, executor=self._eager if eager else None)
        return StepOutput(out["logits"], out["hidden"], span_tokens=span)

    def _forward_fn(self, span: int, split: bool, last_only: bool = False,
                    chunk: tuple[int, int] | None = None) -> Callable:
        model, kv = self.model, self.kv

        def forward_fn(x):
            if chunk is None:
                kv.bind(x["slots"], span)
            else:
                kv.bind_chunk(x["slots"], span, *chunk)
            kv.set_path(split, kv.paged, kv.paged_prefill)
            hidden = model(x["tokens"], x["positions"], kv)  # [Bb, T, H]
            if last_only:
                h_last = hidden.index_select(1, x["last"])  # [1, 1, H]
                return {"logits": model.logits(h_last), "hidden": hidden}
            return {"logits": model.logits(hidden), "hidden": hidden}

        return forward_fn


def graph_chunk_tokens(model: torch.nn.Module) -> int:
    """The longest lone prompt chunk that replays a captured graph for this model (see SMALL_GRAPH_CHUNK_TOKENS)."""
    config = getattr(model, "config", None)
    small = config is not None and config.moe is None and config.hidden_size <= SMALL_HIDDEN
    return SMALL_GRAPH_CHUNK_TOKENS if small else GRAPH_CHUNK_TOKENS

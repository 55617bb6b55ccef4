"""PrefillWindow: a long prompt's chunks run layer by layer over a window, so a cold expert crosses once per window.

Chunk by chunk, every chunk of a long prompt runs through every layer before the next one starts, and a prompt
chunk of a seed-scale MoE (2,048 tokens, top-10 of 512 experts) routes to nearly every expert of every layer: an
expert cache smaller than the experts copies each cold expert in once per chunk (a 176K prompt: ~86 times). Here,
when the scheduler plans a chunk of a prompt whose experts may be cold (the cache holds fewer than every expert),
the engine runs a window of the prompt (up to `window_tokens`, at most its end) layer-major:

    for each layer L:
        for each piece i of the window (--prefill-chunk-tokens; a paced chunk may be smaller, a piece never
            is, so a window is never hundreds of tiny attention calls a layer): attention of piece i at L, which
            reads the KV that pieces < i wrote at L a moment ago (as the chunks before would have), writes its own;
        one MoE over the window's tokens: each routed expert is served once for all of them (copied in at most
            once if cold, its copy overlapped with the compute before it: engine.exec.experts.cache);

and keeps the window's final hidden states. The chunks the scheduler plans inside the window are served from
them (their KV is written already): the chunk's hidden rows, and the logits of its last one (a last chunk samples
its first token from them as ever, and MTP's drafter prefill runs per chunk on the same rows).

The decoding slots keep their steps. With no slot decoding a window is `window_tokens` at once, run in the step
that needs it. While slots decode, no step runs a whole window: the next window is computed a slice of layers at a
time, one slice in each step that serves a chunk of the current window, sized so that it is done when the current
one is used up (its slices are spread over the current window's remaining chunks); and the windows ramp up (the
first is one chunk, each next one twice the last, up to `window_tokens`), so a step computes about two chunks'
worth during the ramp and one after it, as chunk by chunk. A window computed ahead reads the KV the windows before
it wrote; between its slices the slots' steps bind their own KV and move the expert cache's residents, which
neither the window's state (its hidden states between layers) nor its next layer's access depends on. The pacer
(engine.core.prefill_pacer) times the steps that serve chunks with their slices in them, so it paces them.

The tokens are the chunk-by-chunk run's: attention runs per piece with the span and binding a chunk of it would
have had (each query row attends its own causal keys, whichever piece it is in), the norms and projections are
per token, and an expert's product is per token whatever else it computes (the cache runs the experts in
ascending order either way). `window_tokens` bounds the activations: two windows' hidden states (the one served,
the one ahead) and the MoE's per-route products (about (top_k + 6) x hidden x dtype bytes a token at once).

Chunks beside the steps (`--prefill-overlap`) are refused for MoE models (engine.exec.chunk_stream), so a window
never meets one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.exec.graphs.key import GraphKey
from engine.exec.runner import StepOutput, split_switches
from engine.exec.step_buckets import MIN_CHUNK_TOKENS, pow2_bucket
from engine.model.moe import SparseMoE

KIND = "prefill"  # a prefill step as the chunk's (the expert cache's trace and prompt counters read the kind)


@dataclass
class _Window:
    """Prompt positions [start, end) of one slot, run layer-major: `layer` layers done so far; `hidden` (final
    hidden states [end - start, H]) once every layer ran."""

    slot: int
    start: int
    end: int
    pieces: list = field(default_factory=list)  # (tokens [1, T], positions [1, T], start, end) staged
    states: list = field(default_factory=list)  # per piece: the stream between layers (fused ops: the layer output)
    residuals: list = field(default_factory=list)  # per piece: the carried residual (fused ops) or None
    ropes: list = field(default_factory=list)  # per piece: (cos, sin)
    layer: int = 0
    hidden: torch.Tensor | None = None


@dataclass
class _Held:
    """One request's windows: the one its chunks are served from (done) and the next one, computed ahead."""

    done: _Window
    ahead: _Window | None = None


class PrefillWindow:
    """Layer-major prefill windows of long prompts on an MoE model with cold experts (see the module docstring)."""

    def __init__(self, runner: Any, executor: Any, cache: Any, window_tokens: int, piece_tokens: int) -> None:
        """`runner`: the engine's ModelRunner (its model, KV, spans and executor seam); `executor`: the eager step
        executor wrapped in the expert cache's steps (engine.exec.experts.steps); `cache`: the ExpertCache;
        `piece_tokens`: the most tokens one piece attends at once (--prefill-chunk-tokens: the chunk path's bound)."""
        if window_tokens < 0 or piece_tokens < 1:
            raise ValueError(f"window_tokens={window_tokens}, piece_tokens={piece_tokens}: expected >= 0 and >= 1")
        self.runner = runner
        self.executor = executor
        self.cache = cache
        self.window_tokens = window_tokens
        self.piece_tokens = piece_tokens
        self.num_layers = len(runner.model.layers)
        self.decoding = False  # slots decode this step (PlanExecutor sets it per step): windows ramp and slice
        self._held: dict[str, _Held] = {}
        self.windows = 0  # windows begun since start

    def applies(self, chunk: Any) -> bool:
        """Whether `chunk` (engine.step.PrefillChunk) is served by a window: one of its request's covers or
        follows the chunk's start, or its prompt has more left than this chunk and some expert may be cold."""
        if self._held_for(chunk) is not None:
            return True
        left = len(chunk.request.prompt_token_ids) - chunk.start
        return (self.window_tokens > chunk.num_tokens and left > chunk.num_tokens
                and not self.cache.every_expert_resident)

    def forward(self, chunk: Any) -> StepOutput:
        """The chunk's StepOutput (logits [1, 1, V] of its last position, hidden [1, bucket, H]) from the window
        that covers it (run now if none does), and, while slots decode, a slice of the next window."""
        rid, prompt, slot = chunk.request.request_id, chunk.request.prompt_token_ids, chunk.slot
        held = self._held_for(chunk)
        if held is not None and not held.done.start <= chunk.start < held.done.end:  # the next window's turn
            held = _Held(self._finished(held.ahead))
        if held is None:
            first = self.piece_tokens if self.decoding else self.window_tokens
            held = _Held(self._finished(self._begin(slot, prompt, chunk.start, max(first, chunk.num_tokens))))
        while held.done.end < chunk.end:  # the chunk reaches past the window: the next one, now
            nxt = held.ahead or self._begin(slot, prompt, held.done.end, self._next_tokens(held.done))
            held = _Held(_joined(held.done, self._finished(nxt)))
        self._held[rid] = held
        rows = held.done.hidden[chunk.start - held.done.start:chunk.end - held.done.start]  # [n, H]
        if held.ahead is None and held.done.end < len(prompt) and self.decoding:
            held.ahead = self._begin(slot, prompt, held.done.end, self._next_tokens(held.done))
        if held.ahead is not None and held.ahead.hidden is None:
            # spread the rest of the next window over the chunks left in this one (this one included)
            chunks_left = 1 + math.ceil((held.done.end - chunk.end) / max(1, chunk.num_tokens))
            self._advance(held.ahead, math.ceil((self.num_layers - held.ahead.layer) / chunks_left))
        if chunk.end >= held.done.end and held.ahead is None:
            del self._held[rid]  # used up, nothing ahead: the next chunk begins a window of its own
        n = rows.shape[0]
        tb = pow2_bucket(n, MIN_CHUNK_TOKENS)
        hidden = F.pad(rows, (0, 0, 0, tb - n))[None]  # the chunk path's bucket (MTP's drafter prefill reads it)
        with torch.inference_mode():
            logits = self.runner.model.logits(rows[-1:][None])
        return StepOutput(logits, hidden, span_tokens=self.runner.chunk_span(chunk.end))

    def drop(self, request_id: str) -> None:
        """The request finished (or failed): its windows go (its slot's KV is another request's next)."""
        self._held.pop(request_id, None)

    # --- windows -----------------------------------------------------------------------------------------------

    def _held_for(self, chunk: Any) -> _Held | None:
        """The request's windows if one covers the chunk's start (the served one, or the next one at its start)."""
        held = self._held.get(chunk.request.request_id)
        if held is None or held.done.slot != chunk.slot:
            return None
        if held.done.start <= chunk.start < held.done.end:
            return held
        return held if held.ahead is not None and held.ahead.start == chunk.start else None

    def _next_tokens(self, done: _Window) -> int:
        """The next window's size: twice the last while slots decode (up to window_tokens), else window_tokens."""
        if not self.decoding:
            return self.window_tokens
        return min(self.window_tokens, 2 * (done.end - done.start))

    def _begin(self, slot: int, prompt: list[int], start: int, tokens: int) -> _Window:
        """A window of prompt positions [start, start + tokens) (at most the prompt's end), no layer run yet."""
        r = self.runner
        end = min(len(prompt), start + max(tokens, 1))
        window = _Window(slot, start, end)
        for s in range(start, end, self.piece_tokens):
            e = min(end, s + self.piece_tokens)
            window.pieces.append((r.stage([prompt[s:e]]), r.stage([list(range(s, e))]), s, e))
        self.windows += 1
        return window

    def _finished(self, window: _Window) -> _Window:
        if window.hidden is None:
            self._advance(window, self.num_layers)
        return window

    def _advance(self, window: _Window, layers: int) -> None:
        """Run up to `layers` more layers of `window` as one prefill step through the expert cache's executor."""
        r = self.runner
        first, stop = window.layer, min(self.num_layers, window.layer + max(1, layers))
        r.kv.prepare({window.slot: window.end + r.lookahead_tokens})
        # every row of the window is real: the expert cache's step marks them all (no padding rows)
        inputs = {"slots": r.stage([window.slot]), "positions": r.stage([list(range(window.start, window.end))])}

        def build(split: bool):  # eager, never captured: the key names the slice (a "t" part: it runs chunks)
            key = GraphKey.of(f"t{self.piece_tokens}", f"s{window.start}", f"e{window.end}", f"l{first}-{stop}",
                              switches=split_switches(split))
            return key, lambda x: self._layers(window, x["slots"], first, stop, split)

        out = r.run(KIND, build, inputs, executor=self.executor)
        window.states, window.residuals, window.layer = out["states"], out["residuals"], stop
        if stop == self.num_layers:
            window.hidden = out["hidden"]
            window.states, window.residuals, window.ropes, window.pieces = [], [], [], []

    def _layers(self, w: _Window, slots: torch.Tensor, first: int, stop: int, split: bool) -> dict:
        """Layers [first, stop) of the window from its state after layer `first` (CausalLM.forward's sums with
        the layers outermost). It changes nothing of the window: the expert cache's executor may run a step again
        (after a miss on its captured path, or an out-of-memory), which must start from the same state; `_advance`
        keeps what the step returned."""
        model, kv = self.runner.model, self.runner.kv
        if not w.ropes:
            w.ropes = [model.rotary(positions, model.embed_tokens.weight.dtype) for _, positions, _, _ in w.pieces]
        if first == 0:
            states = [model.embed_tokens(tokens) for tokens, _, _, _ in w.pieces]  # [1, T, H] each
            residuals = [None] * len(states)
        else:
            states, residuals = list(w.states), list(w.residuals)
        for i in range(first, stop):
            layer = model.layers[i]
            mlp_in, streams = [], []
            for p, (_, positions, s, e) in enumerate(w.pieces):
                self._bind(slots, s, e, split)
                cos, sin = w.ropes[p]
                normed, stream = layer.attention_half(states[p], residuals[p], cos, sin, positions, kv, i)
                mlp_in.append(normed)
                streams.append(stream)
            if isinstance(layer.mlp, SparseMoE):  # one access for the window's tokens: each expert served once
                outs = layer.mlp(torch.cat(mlp_in, dim=1), torch.cat([p[1] for p in w.pieces], dim=1))
                outs = outs.split([m.shape[1] for m in mlp_in], dim=1)
            else:
                outs = [layer.mlp(m) for m in mlp_in]
            if model.ops is not None:  # the stream's add rides in the next norm (forward_carry)
                states, residuals = list(outs), streams
            else:
                states, residuals = [st + out for st, out in zip(streams, outs)], [None] * len(outs)
        hidden = None
        if stop == self.num_layers:
            if model.ops is not None:
                finals = [model.ops.add_rms_norm(st, res, model.norm.weight, model.norm.eps)[0]
                          for st, res in zip(states, residuals)]
            else:
                finals = [model.norm(st) for st in states]
            hidden = torch.cat(finals, dim=1)[0]
        return {"states": states, "residuals": residuals, "hidden": hidden}

    def _bind(self, slots: torch.Tensor, start: int, end: int, split: bool) -> None:
        """The KV binding the chunk [start, end) would have had on its own (engine.exec.runner.ModelRunner.prefill
        decides the same way): its span; the fused causal attention where the device takes the chunk and the paged
        chunk kernel does not (a chunk of at most the runner's graph_chunk_tokens on the PAGED_PREFILL path)."""
        r, kv = self.runner, self.runner.kv
        span, n = r.chunk_span(end), end - start
        tb = pow2_bucket(n, MIN_CHUNK_TOKENS)
        paged_chunk = tb <= r.graph_chunk_tokens and kv.paged_prefill
        if not paged_chunk and kv.chunk_fusable(r.model.config.num_attention_heads, tb):
            kv.bind_chunk(slots, span, start, n)  # unpadded: row i sees keys <= start + i
        else:
            kv.bind(slots, span)
        kv.set_path(split, kv.paged, kv.paged_prefill)


def _joined(first: _Window, second: _Window) -> _Window:
    """Two finished windows back to back as one."""
    return _Window(first.slot, first.start, second.end, hidden=torch.cat([first.hidden, second.hidden]))

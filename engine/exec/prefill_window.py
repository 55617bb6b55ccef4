"""PrefillWindow: a long prompt's chunks run layer by layer over a window, so a cold expert crosses once per window.

Chunk by chunk, every chunk of a long prompt runs through every layer before the next one starts, and a prompt
chunk of a seed-scale MoE (2,048 tokens, top-10 of 512 experts) routes to nearly every expert of every layer: an
expert cache smaller than the experts copies each cold expert in once per chunk (a 176K prompt: ~86 times). Here,
when the scheduler plans the first chunk of a prompt whose experts may be cold (the cache holds fewer than every
expert), the engine runs the window `[start, start + window_tokens)` of the prompt (at most its end) layer-major:

    for each layer L:
        for each piece i of the window (--prefill-chunk-tokens; a paced chunk may be smaller, a piece never
            is, so a window is never hundreds of tiny attention calls a layer): attention of piece i at L, which
            reads the KV that pieces < i wrote at L a moment ago (as the chunks before would have), writes its own;
        one MoE over the window's tokens: each routed expert is served once for all of them (copied in at most
            once if cold, engine.exec.experts.cache), its copy overlapped on the side stream as the cache does;

and keeps the window's final hidden states. The chunks the scheduler plans next inside the window are then
served from them (their KV is written already): the chunk's hidden rows, and the logits of its last one (a last
chunk samples its first token from them as ever, and MTP's drafter prefill runs per chunk on the same hidden
rows). A chunk that reaches past the window starts the next window at the window's end.

The tokens are the chunk-by-chunk run's: attention runs per piece with the span and binding a chunk of it would
have had (each query row attends its own causal keys, whichever piece it is in), the norms and projections are
per token, and an expert's product is per token whatever else it computes (the cache runs the experts in
ascending order either way). `window_tokens` bounds the activations: the window's
hidden states and the MoE's per-route products (about (top_k + 6) x hidden x dtype bytes a token at once).

The window runs within the step that planned its first chunk: the decoding slots wait for the whole window
once, then its other chunks cost them nothing (`--prefill-window-tokens 0`: chunk by chunk, as before). Chunks
beside the steps (`--prefill-overlap`) are refused for MoE models (engine.exec.chunk_stream), so a window never
meets one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.exec.graphs.key import GraphKey
from engine.exec.runner import GRAPH_CHUNK_TOKENS, MIN_CHUNK_TOKENS, StepOutput, pow2_bucket, split_switches
from engine.model.moe import SparseMoE

KIND = "prefill"  # a prefill step as the chunk's (the expert cache's trace and prompt counters read the kind)


@dataclass
class _Stash:
    """A window's result for one request: final hidden states [end - start, H] of its prompt positions."""

    slot: int
    start: int
    end: int
    hidden: torch.Tensor


class PrefillWindow:
    """Layer-major prefill windows of long prompts on an MoE model with cold experts (see the module docstring)."""

    def __init__(self, runner: Any, executor: Any, cache: Any, window_tokens: int, piece_tokens: int) -> None:
        """`runner`: the engine's ModelRunner (its model, KV, spans and executor seam); `executor`: the eager step
        executor wrapped in the expert cache's steps (engine.exec.experts.steps); `cache`: the ExpertCache;
        `piece_tokens`: the most tokens one piece attends at once (--prefill-chunk-tokens: the chunk path's bound)."""
        if window_tokens < 0 or piece_tokens < 1:
            raise ValueError(f"window_tokens={window_tokens}, piece_tokens={piece_tokens}: expected >= 0 and >= 1")
        self.piece_tokens = piece_tokens
        self.runner = runner
        self.executor = executor
        self.cache = cache
        self.window_tokens = window_tokens
        self._stash: dict[str, _Stash] = {}
        self.windows = 0  # windows run since start

    def applies(self, chunk: Any) -> bool:
        """Whether `chunk` (engine.step.PrefillChunk) is served by a window: one of it covers the chunk already,
        or its prompt has more left than this chunk and some expert may be cold."""
        held = self._stash.get(chunk.request.request_id)
        if held is not None and held.slot == chunk.slot and held.start <= chunk.start < held.end:
            return True
        left = len(chunk.request.prompt_token_ids) - chunk.start
        return (self.window_tokens > chunk.num_tokens and left > chunk.num_tokens
                and not self.cache.every_expert_resident)

    def forward(self, chunk: Any) -> StepOutput:
        """The chunk's StepOutput (logits [1, 1, V] of its last position, hidden [1, bucket, H]), from the window
        that covers it, run now if none does."""
        rid, prompt = chunk.request.request_id, chunk.request.prompt_token_ids
        held = self._stash.get(rid)
        if held is None or held.slot != chunk.slot or not held.start <= chunk.start < held.end:
            held = self._run(chunk.slot, prompt, chunk.start, max(chunk.num_tokens, self.piece_tokens))
        while held.end < chunk.end:  # the chunk reaches past the window: the next one, from its end
            more = self._run(chunk.slot, prompt, held.end, max(chunk.num_tokens, self.piece_tokens))
            held = _Stash(chunk.slot, held.start, more.end, torch.cat([held.hidden, more.hidden]))
        self._stash[rid] = held
        rows = held.hidden[chunk.start - held.start:chunk.end - held.start]  # [n, H]
        if chunk.end >= held.end:
            del self._stash[rid]  # used up: the next chunk starts a window of its own
        n = rows.shape[0]
        tb = pow2_bucket(n, MIN_CHUNK_TOKENS)
        hidden = F.pad(rows, (0, 0, 0, tb - n))[None]  # the chunk path's bucket (MTP's drafter prefill reads it)
        with torch.inference_mode():
            logits = self.runner.model.logits(rows[-1:][None])
        return StepOutput(logits, hidden, span_tokens=self.runner.chunk_span(chunk.end))

    def drop(self, request_id: str) -> None:
        """The request finished (or failed): its window's rows go (its slot's KV is another request's next)."""
        self._stash.pop(request_id, None)

    # --- the window ------------------------------------------------------------------------------------------

    def _run(self, slot: int, prompt: list[int], start: int, piece_tokens: int) -> _Stash:
        """Run prompt positions [start, start + window) layer-major in pieces of `piece_tokens`."""
        r = self.runner
        end = min(len(prompt), start + max(self.window_tokens, piece_tokens))
        r.kv.prepare({slot: end + r.lookahead_tokens})
        bounds = [(s, min(end, s + piece_tokens)) for s in range(start, end, piece_tokens)]
        inputs = {"slots": r.stage([slot]),
                  "pieces": [(r.stage([prompt[s:e]]), r.stage([list(range(s, e))]), s, e) for s, e in bounds],
                  # every row of the window is real: the expert cache's step marks them all (no padding rows)
                  "positions": r.stage([list(range(start, end))])}

        def build(split: bool):  # eager, never captured: the key names the window (a "t" part: it runs chunks)
            key = GraphKey.of(f"t{piece_tokens}", f"s{start}", f"e{end}", switches=split_switches(split))
            return key, lambda x: {"hidden": self._layer_major(x, split)}

        out = r.run(KIND, build, inputs, owner=r.prefill_owner, executor=self.executor)
        self.windows += 1
        return _Stash(slot, start, end, out["hidden"])

    def _layer_major(self, x: dict, split: bool) -> torch.Tensor:
        """[window tokens, H]: the model's forward (CausalLM.forward's sums) with the layers outermost."""
        r = self.runner
        model, kv = r.model, r.kv
        pieces = x["pieces"]
        states, residuals, ropes = [], [], []
        for tokens, positions, _, _ in pieces:
            h = model.embed_tokens(tokens)  # [1, T, H]
            states.append(h)
            residuals.append(None)
            ropes.append(model.rotary(positions, h.dtype))
        for i, layer in enumerate(model.layers):
            mlp_in = []
            for p, (tokens, positions, s, e) in enumerate(pieces):
                self._bind(x["slots"], s, e, split)
                cos, sin = ropes[p]
                normed, stream = layer.attention_half(states[p], residuals[p], cos, sin, positions, kv, i)
                mlp_in.append(normed)
                residuals[p] = stream
            if isinstance(layer.mlp, SparseMoE):  # one access for the window's tokens: each expert served once
                outs = layer.mlp(torch.cat(mlp_in, dim=1), torch.cat([p[1] for p in pieces], dim=1))
                outs = outs.split([m.shape[1] for m in mlp_in], dim=1)
            else:
                outs = [layer.mlp(m) for m in mlp_in]
            for p, out in enumerate(outs):
                if model.ops is not None:  # the stream's add rides in the next norm (forward_carry)
                    states[p] = out
                else:
                    states[p], residuals[p] = residuals[p] + out, None
        finals = []
        for p in range(len(pieces)):
            if model.ops is not None:
                finals.append(model.ops.add_rms_norm(states[p], residuals[p], model.norm.weight, model.norm.eps)[0])
            else:
                finals.append(model.norm(states[p]))
        return torch.cat(finals, dim=1)[0]

    def _bind(self, slots: torch.Tensor, start: int, end: int, split: bool) -> None:
        """The KV binding the chunk [start, end) would have had on its own (engine.exec.runner.ModelRunner.prefill
        decides the same way): its span; the fused causal attention where the device takes the chunk and the paged
        chunk kernel does not (a chunk of at most GRAPH_CHUNK_TOKENS on the PAGED_PREFILL path)."""
        r, kv = self.runner, self.runner.kv
        span, n = r.chunk_span(end), end - start
        tb = pow2_bucket(n, MIN_CHUNK_TOKENS)
        paged_chunk = tb <= GRAPH_CHUNK_TOKENS and kv.paged_prefill
        if not paged_chunk and kv.chunk_fusable(r.model.config.num_attention_heads, tb):
            kv.bind_chunk(slots, span, start, n)  # unpadded: row i sees keys <= start + i
        else:
            kv.bind(slots, span)
        kv.set_path(split, kv.paged, kv.paged_prefill)

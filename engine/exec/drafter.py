"""MTP drafting: the MTP head's own KV (layers L..), one batched pass for all decoding slots, chained to depth K.

The MTP layer at position p reads (h_p, token p+1) and predicts token p+2. Its KV at p must come from the
main model's real h_p, so every forward of the main model is followed by an MTP pass over the same positions:

- draft_prefill: over a prompt chunk (next ids = the prompt shifted by one; on the last chunk the final
  next id is the first sampled token). On the last chunk it also yields the first draft.
- draft_round: after a verify of [pending + K drafts] at positions n..n+K, over those K+1 positions with the
  tokens the verify emitted; row b's draft comes from position n + accepted_b (picked with a gather, so the
  whole batch is one static-shape forward). Positions past the accepted ones hold junk KV that the next round
  overwrites before anything can read it (attention is causal by position).
- draft_step j (1..K-1): chains the head on its own output (hidden g_j, draft d_j) one position further, the
  way vLLM chains a one-layer MTP head; the depth-j layer is `j % num_mtp_layers`.

Drafts are greedy (argmax); the sampler's rejection rule accounts for that (engine.exec.sampler). New drafts go
straight into the runner's device-side `draft_buf[slot]`, so no draft token crosses to the host before verify.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.exec.step_fns import EagerExecutor
from engine.exec.graphs.key import GraphKey
from engine.exec.graphs.cache import GraphSpec
from engine.exec.mtp_accept import chain_positions, greedy_acceptance, greedy_acceptance_kernel
from engine.exec.runner import ModelRunner, Row, split_switches
from engine.exec.step_buckets import MIN_CHUNK_TOKENS, pow2_bucket
from engine.exec.sampler import finite_rows, flag_non_finite, sample_on_device, sampling_inputs

FUSED_KIND = "verify_draft"


class FusedStep(NamedTuple):
    """What verify_and_draft gives, on the device: per row the accepted count [Bb], the tokens [Bb, K+1] (a row
    emits tokens[:accepted + 1]) and the two side by side [Bb, K+2] (one copy to the host; a row whose logits were
    not finite has sampler.NO_TOKEN for its tokens there, see sampler.non_finite_rows); for a greedy step the
    next step's packed inputs (`next_inputs`, runner.verify_inputs' columns: a step launched ahead of the host
    takes them as they are, engine.exec.decode_ahead), else None; and the step's span."""

    accepted: torch.Tensor
    tokens: torch.Tensor
    emitted: torch.Tensor
    next_inputs: torch.Tensor | None
    span: int


class MtpDrafter:
    """Proposes `depth` draft tokens per decoding slot with the checkpoint's MTP head."""

    def __init__(self, runner: ModelRunner, depth: int, fused: bool | None = None) -> None:
        if runner.model.mtp is None:
            raise ValueError("MTP drafting needs a checkpoint with an MTP head")
        self.runner = runner
        self.depth = depth
        self.model = runner.model
        self.kv = runner.kv
        # `verify_and_draft`: on by default where steps are captured graphs on CUDA (one replay and one
        # device-to-host copy per step instead of two replays, a host round trip and the round's input
        # copies); the separate kinds stay for CPU unless forced.
        if fused is None:
            fused = runner.device.type == "cuda" and not isinstance(runner.graphs, EagerExecutor)
        self.fused = fused

    # --- the fused step ---------------------------------------------------------------------------------------

    def verify_and_draft(self, rows: list[Row], params: list | None = None,
                         generators: list | None = None) -> FusedStep:
        """Verify, acceptance and the next round's drafts in one step function (kind verify_draft).

        Acceptance needs no host: greedy rows accept drafts while they equal the argmax; sampled rows run the
        rejection sampler on the device (engine.exec.sampler.sample_on_device) with uniforms drawn on the host from
        each request's own generator, exactly as the separate path draws them. So the draft round (and its
        chain steps) can follow on the device, reading the emitted tokens and the accepted count where
        `round()` gets them from the host. `params` None (or all greedy): the argmax-only variant. Returns a
        FusedStep; the drafts are in draft_buf. Same tokens and drafts as verify + sample_with_drafts + round.
        """
        r, k = self.runner, self.depth
        slots, positions = r.pad_rows(rows, k + 1)
        bb = len(slots)
        # Chain step j writes MTP KV at n + accepted + j <= n + 2K - 1: the span covers the chain too.
        span = r.step_span(max(row.position for row in rows) + 2 * k)
        draft_rows = [row.slot for row in rows] + [r.pad_row] * (bb - len(rows))
        pending = [row.token for row in rows] + [0] * (bb - len(rows))
        inputs = r.verify_inputs(slots, draft_rows, pending, positions)
        mode = "greedy"
        if params is not None and any(p.temperature > 0 for p in params):
            sampling = sampling_inputs(params, generators, k + 1, r.device, rows=bb)
            inputs.update(temperature=sampling.temperature, top_p=sampling.top_p, uniforms=sampling.uniforms)
            mode = "top_p" if sampling.use_top_p else "sampled"
        return self._run_fused(inputs, span, mode)

    def verify_and_draft_ahead(self, step: FusedStep) -> FusedStep:
        """The greedy fused step after `step`, of the same rows, launched before the host has read `step`: its
        inputs are the ones `step` computed on the device (each row's pending token tokens[accepted], its
        positions moved by accepted + 1), staged from nothing on the host (engine.exec.decode_ahead)."""
        assert step.next_inputs is not None, "only a greedy step computes the next one's inputs"
        # A copy (one device copy, no host): `next_inputs` is an output of the graph this step replays, so the
        # replay overwrites it with the inputs of the step after. A step run again after an expert-cache miss
        # (engine.exec.experts.steps: replayed or rerun eagerly) would then verify one step further on, and the
        # tokens of this one, already in the KV, would never reach the host.
        packed = step.next_inputs.clone()
        inputs = {"slots": packed[:, 0], "draft_rows": packed[:, 1], "pending": packed[:, 2:3],
                  "positions": packed[:, 3:]}
        return self._run_fused(inputs, step.span, "greedy")

    def _run_fused(self, inputs: dict, span: int, mode: str) -> FusedStep:
        bb = inputs["slots"].shape[0]
        out = self.runner.run(FUSED_KIND, self._fused_build(bb, span, mode), inputs, owner="drafter")
        # Stored after the step, not inside it: a step that reads draft_buf must not write it, or a second
        # execution (a capture retried after an out-of-memory, a degraded switch's rerun) would verify the
        # drafts the first one made. Padded rows write the buffer's scratch row.
        self.runner.draft_buf.index_copy_(0, inputs["draft_rows"], out["drafts"])
        return FusedStep(out["accepted"], out["tokens"], out["emitted"], out.get("next_inputs"), span)

    def _fused_build(self, bb: int, span: int, mode: str = "greedy"):
        k, context = self.depth, self.runner.context_tokens
        verify_build = self.runner.verify_build(bb, span)
        # FUSED_OPS: the acceptance in one Triton kernel (the switch's start-up probe found Triton working here)
        acceptance = greedy_acceptance_kernel if self.model.ops is not None else greedy_acceptance

        def build(split: bool):
            _, verify_fn = verify_build(split)
            round_fn = self._mtp_fn(span, split, depth=0)
            step_fns = [self._mtp_fn(span, split, depth=j) for j in range(1, k)]

            def fused_fn(x):
                out = verify_fn(x)
                next_inputs = None
                # The finite check in the step: a row whose logits hold NaN or inf emits sampler.NO_TOKEN in
                # `emitted`, the one copy the host reads (sampler.non_finite_rows), so it costs no sync of its own.
                # `tokens` and `next_inputs` stay ids: the round below and a step launched ahead feed them on.
                finite = finite_rows(out["logits"])  # [Bb]
                if mode == "greedy":
                    tokens = out["logits"].argmax(dim=-1)  # [Bb, K+1]: accepted drafts equal it
                    # with the next step's inputs, for a step launched before the host reads this one
                    accepted, emitted, next_inputs, chain = acceptance(
                        tokens, out["drafts"], x["slots"], x["draft_rows"], x["pending"], x["positions"], context,
                        finite)
                else:
                    accepted, tokens = sample_on_device(out["logits"], out["drafts"], x["temperature"], x["top_p"],
                                                        x["uniforms"], use_top_p=mode == "top_p")
                    # accepted and tokens side by side as well: the host reads both with one copy
                    emitted = torch.cat([accepted.view(bb, 1), flag_non_finite(tokens, finite)], dim=1)
                    chain = chain_positions(x["positions"], accepted, k)
                # The round over the verified positions n..n+K with the emitted tokens as next ids; past the
                # accepted ones they are junk that the next round overwrites before anything reads it.
                d = round_fn({"slots": x["slots"], "hidden": out["hidden"], "next_ids": tokens,
                              "positions": x["positions"], "pick": accepted})
                drafts, h = [d["draft"]], d["h"]
                for j, step_fn in enumerate(step_fns, start=1):  # at n + accepted + j
                    d = step_fn({"slots": x["slots"], "hidden": h, "next_ids": drafts[-1].view(bb, 1),
                                 "positions": chain[:, j - 1:j]})
                    drafts.append(d["draft"])
                    h = d["h"]
                result = {"accepted": accepted, "tokens": tokens, "emitted": emitted,
                          "drafts": torch.stack(drafts, dim=1)}
                if next_inputs is not None:
                    result["next_inputs"] = next_inputs
                return result

            # Greedy keeps the verify-like key; the sampled variants (other inputs, other kernels) say so.
            mode_tag = () if mode == "greedy" else (mode,)
            key = GraphKey.of(f"b{bb}", f"k{k}", f"L{span}", *mode_tag, switches=split_switches(split))
            return key, fused_fn

        return build

    # --- passes ----------------------------------------------------------------------------------------------

    def prefill(self, slot: int, hidden: torch.Tensor, next_ids: list[int], start: int, is_last: bool) -> None:
        """MTP KV for prompt positions [start, start+n); on the last chunk, draft the slot's first K tokens."""
        r = self.runner
        n = len(next_ids)
        tb = hidden.shape[1]
        assert tb == pow2_bucket(n, MIN_CHUNK_TOKENS), (tb, n)
        span = r.chunk_span(start + n)
        positions = [start + j for j in range(n)] + [r.pad_start_tokens + j for j in range(tb - n)]
        inputs = {"slots": r.stage([slot]), "hidden": hidden, "next_ids": r.stage([list(next_ids) + [0] * (tb - n)]),
                  "positions": r.stage([positions]), "pick": r.stage([n - 1])}

        out = r.run("draft_prefill", self._prefill_build(tb, span), inputs, owner="drafter")
        if is_last:
            rows = [Row(slot, next_ids[-1], start + n)]  # the pending (first sampled) token and its position
            self._finish(rows, 1, out["draft"], out["h"], inputs["slots"])

    def round(self, rows: list[Row], hidden: torch.Tensor, emitted: list[list[int]], base_positions: list[int]) -> None:
        """After a verify: MTP over positions n..n+K of each row, drafting from position n + accepted.

        `rows` carry each slot and its new pending token/position; `emitted[b]` the tokens verify emitted
        (accepted drafts then one sampled token); `base_positions[b]` = n, the verified pending's position.
        """
        r = self.runner
        k1 = hidden.shape[1]
        bb = hidden.shape[0]
        span = r.step_span(max(base_positions) + k1)
        r.kv.prepare({row.slot: n + k1 + r.lookahead_tokens for row, n in zip(rows, base_positions)})
        next_ids = [list(e) + [0] * (k1 - len(e)) for e in emitted] + [[0] * k1] * (bb - len(rows))
        positions = [[n + j for j in range(k1)] for n in base_positions]
        positions += [[r.pad_start_tokens + j for j in range(k1)]] * (bb - len(rows))
        slots = [row.slot for row in rows] + [0] * (bb - len(rows))
        pick = [len(e) - 1 for e in emitted] + [0] * (bb - len(rows))
        # One host-to-device copy for every input ([Bb, 2 + 2 * k1] split into views): a round runs every
        # decode step, and each separate copy costs host time comparable to a small model's kernels.
        packed = r.stage([[sl, pk] + ids + pos for sl, pk, ids, pos in zip(slots, pick, next_ids, positions)])
        inputs = {"slots": packed[:, 0], "hidden": hidden, "next_ids": packed[:, 2:2 + k1],
                  "positions": packed[:, 2 + k1:], "pick": packed[:, 1]}

        out = r.run("draft_round", self._round_build(bb, k1, span), inputs, owner="drafter")
        self._finish(rows, bb, out["draft"], out["h"], inputs["slots"])

    def _finish(self, rows: list[Row], bb: int, first: torch.Tensor, h: torch.Tensor, slots_t: torch.Tensor) -> None:
        """Chain steps 1..K-1 from the first draft, then store all K drafts per slot in draft_buf.

        `slots_t` [Bb] is the slots on the device (the real rows first), as the round or prefill staged them.
        """
        r = self.runner
        drafts = [first]  # each [Bb]
        for j in range(1, self.depth):
            # Chain step j sits at pending position + j - 1 (the round's pick was at pending - 1).
            pos = [row.position + j - 1 for row in rows] + [r.pad_start_tokens] * (bb - len(rows))
            span = r.step_span(max(row.position for row in rows) + j)
            inputs = {"slots": slots_t, "hidden": h, "next_ids": drafts[-1].view(bb, 1),
                      "positions": r.stage([[p] for p in pos]), "pick": r.stage([0] * bb)}
            out = r.run("draft_step", self._step_build(bb, j, span), inputs, owner="drafter")
            drafts.append(out["draft"])
            h = out["h"]
        stacked = torch.stack(drafts, dim=1)[: len(rows)]  # [B, K]
        r.draft_buf.index_copy_(0, slots_t[: len(rows)], stacked)

    # --- CAPTURE_ALL ---------------------------------------------------------------------------------------

    def graph_specs(self, max_chunk_tokens: int) -> list[GraphSpec]:
        """CAPTURE_ALL: a GraphSpec for every drafter bucket on the current SPLIT_ATTN path.

        draft_prefill: each chunk bucket (16 .. the bucket of `max_chunk_tokens`) with each length bucket a
        chunk of that size can reach; draft_round (1 + depth tokens) and draft_step j = 1..depth-1: each batch
        bucket with each length bucket. With the fused step on, its greedy variant takes draft_round's place
        (and the runner's verify), and draft_step is needed only at batch 1, for a prompt's first drafts; its
        sampled variants are captured on first need. Inputs are padding rows only (slot 0's scratch columns,
        zero hidden states), so the warm-up a capture executes writes no real KV.
        """
        r = self.runner
        split = r.split_enabled()
        dtype = next(self.model.parameters()).dtype
        hidden_size = self.model.config.hidden_size
        spans = r.chunk_spans()  # a prompt chunk's (the prefill kernel or the reference reads up to its span)
        step_spans = r.step_spans()
        specs = []
        tb = MIN_CHUNK_TOKENS
        while tb <= pow2_bucket(max_chunk_tokens, MIN_CHUNK_TOKENS):
            inputs = {"slots": r.stage([0]), "hidden": torch.zeros(1, tb, hidden_size, dtype=dtype, device=r.device),
                      "next_ids": r.stage([[0] * tb]), "positions": r.stage(r.pad_positions(1, tb)),
                      "pick": r.stage([0])}
            # A chunk of this bucket holds more than tb / 2 tokens, so it ends past them.
            for span in (s for s in spans if s >= r.chunk_span(tb // 2 + 1)):
                key, fn = r.on_path(*self._prefill_build(tb, span)(split))
                specs.append(GraphSpec("draft_prefill", key, fn, inputs, owner="drafter"))
            tb *= 2
        for bb in r.batch_buckets():
            if self.fused:  # greedy batches take verify_draft instead of verify + draft_round (+ steps)
                inputs = r.verify_inputs([0] * bb, [r.pad_row] * bb, [0] * bb, r.pad_positions(bb, self.depth + 1))
                for span in step_spans:
                    key, fn = r.on_path(*self._fused_build(bb, span)(split))
                    specs.append(GraphSpec(FUSED_KIND, key, fn, inputs, owner="drafter"))
            for j in range(self.depth):
                if self.fused and (j == 0 or bb > 1):  # rounds are fused; chain steps follow a prompt alone
                    continue
                t = self.depth + 1 if j == 0 else 1  # a round reads the verify's K+1 positions; a step one
                inputs = {"slots": r.stage([0] * bb),
                          "hidden": torch.zeros(bb, t, hidden_size, dtype=dtype, device=r.device),
                          "next_ids": r.stage([[0] * t] * bb), "positions": r.stage(r.pad_positions(bb, t)),
                          "pick": r.stage([0] * bb)}
                for span in step_spans:
                    build = self._round_build(bb, t, span) if j == 0 else self._step_build(bb, j, span)
                    key, fn = r.on_path(*build(split))
                    specs.append(GraphSpec("draft_round" if j == 0 else "draft_step", key, fn, inputs,
                                           owner="drafter"))
        return specs

    def _prefill_build(self, tb: int, span: int):
        def build(split: bool):
            # Capturable per (chunk bucket, span): positions travel as tensors, so no chunk start in the key.
            return GraphKey.of(f"t{tb}", f"L{span}", switches=split_switches(split)), self._mtp_fn(span, split, depth=0)

        return build

    def _round_build(self, bb: int, k1: int, span: int):
        def build(split: bool):
            key = GraphKey.of(f"b{bb}", f"k{k1 - 1}", f"L{span}", switches=split_switches(split))
            return key, self._mtp_fn(span, split, depth=0)

        return build

    def _step_build(self, bb: int, j: int, span: int):
        def build(split: bool):
            key = GraphKey.of(f"b{bb}", f"j{j}", f"L{span}", switches=split_switches(split))
            return key, self._mtp_fn(span, split, depth=j)

        return build

    def _mtp_fn(self, span: int, split: bool, depth: int):
        model, kv = self.model, self.kv

        def mtp_fn(x):
            kv.bind(x["slots"], span)
            kv.set_path(split, kv.paged, kv.paged_prefill)
            h_mtp = model.mtp(x["hidden"], x["next_ids"], x["positions"], kv, depth=depth)  # [Bb, T, H]
            bb = h_mtp.shape[0]
            if h_mtp.shape[1] == 1:  # a chain step's one position is its pick
                h_pick = h_mtp
            else:
                idx = x["pick"].view(bb, 1, 1).expand(bb, 1, h_mtp.shape[-1])
                h_pick = h_mtp.gather(1, idx)  # [Bb, 1, H]
            logits = model.draft_logits(h_pick, depth)  # [Bb, 1, V]
            return {"draft": logits.argmax(dim=-1).view(bb), "h": h_pick}

        return mtp_fn

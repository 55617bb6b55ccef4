"""Several requests' prompt chunks in one forward: the rows of a burst of prompts admitted together.

A step's plan may hold a chunk of each of many prefilling requests (the scheduler spends the step token budget
on them in admission order). Run one forward per chunk and a burst of 128 short prompts is 128 forwards, each
too small to fill the device and each paying its launches; as rows of one forward `[N, T]` they are one.

Rows are grouped by the chunk's length bucket (`pow2_bucket(tokens)`, the shape a lone chunk is padded to), so
a row is padded exactly as it would be alone (its tail at the scratch positions past the context) and the
drafter's prefill of its hidden states sees the shape it expects. Each row names its own slot and positions:
the KV write lands in each row's slot, and attention is causal by position within each row's own slot, on the
reference path (its gather reads each row's keys) and in the paged prefill kernel (one program per row, query
head and query tile, each streaming only its row's keys up to its positions). A group of one chunk keeps the
lone chunk's path (a short chunk's graph replay, the fused chunk attention).

Where rows are batched (`batches_chunks`): on a CPU, where the reference path runs anyway, and on CUDA where the
paged prefill kernel runs the chunks (PAGED_PREFILL): the reference path there would build each row's mask over
the whole span and lose the fused causal attention a lone chunk has.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.exec.graphs.key import GraphKey
from engine.exec.runner import PREFILL_SWITCH, ModelRunner, StepOutput, split_switches
from engine.exec.step_buckets import MIN_CHUNK_TOKENS, pow2_bucket
from engine.step import PrefillChunk


def chunk_groups(chunks: list[PrefillChunk], bucket_of: Callable[[int], int],
                 max_tokens: int | None = None) -> list[list[PrefillChunk]]:
    """`chunks` split into groups of one length bucket (`bucket_of(tokens)`), each in plan order and of at most
    `max_tokens` padded tokens (rows x bucket; one row at least: 0 puts every chunk alone); the groups in the order
    of their first chunk."""
    groups: list[list[PrefillChunk]] = []
    open_group: dict[int, list[PrefillChunk]] = {}
    for chunk in chunks:
        bucket = bucket_of(chunk.num_tokens)
        group = open_group.get(bucket)
        if group is None or (max_tokens is not None and (len(group) + 1) * bucket > max_tokens):
            group = open_group[bucket] = []
            groups.append(group)
        group.append(chunk)
    return groups


def batches_chunks(runner: ModelRunner) -> bool:
    """Whether several chunks may run as rows of one forward on this runner's current path."""
    if torch.device(runner.device).type == "cpu":
        return True
    return runner.paged_enabled() and runner.board.enabled(PREFILL_SWITCH)


def prefill_rows(runner: ModelRunner, rows: list[tuple[int, list[int], int]]) -> StepOutput:
    """Prompt tokens of several slots in one forward, each row (slot, token ids, start) at positions
    [start, start + n) of its slot: logits [N, 1, V] at each row's last real position, hidden [N, T, H]
    (T: the rows' common length bucket)."""
    lengths = [len(ids) for _, ids, _ in rows]
    tb = pow2_bucket(max(lengths), MIN_CHUNK_TOKENS)
    runner.kv.prepare({slot: start + len(ids) + runner.lookahead_tokens for slot, ids, start in rows})
    span = runner.chunk_span(max(start + len(ids) for _, ids, start in rows))
    pad = runner.pad_start_tokens
    tokens = [list(ids) + [0] * (tb - len(ids)) for _, ids, _ in rows]
    positions = [[start + j for j in range(len(ids))] + [pad + j for j in range(tb - len(ids))]
                 for _, ids, start in rows]
    inputs = {"slots": runner.stage([slot for slot, _, _ in rows]), "tokens": runner.stage(tokens),
              "positions": runner.stage(positions), "last": runner.stage([n - 1 for n in lengths])}
    model, kv = runner.model, runner.kv

    def build(split: bool):
        # eager (a graph per row count and bucket would rarely replay): keyed like a chunk, so the path switches
        # of prompt chunks (PAGED_PREFILL) apply to it
        key = GraphKey.of(f"r{len(rows)}", f"t{tb}", f"L{span}", switches=split_switches(split))

        def forward_fn(x):
            kv.bind(x["slots"], span)
            kv.set_path(split, kv.paged, kv.paged_prefill)
            hidden = model(x["tokens"], x["positions"], kv)  # [N, T, H]
            last = x["last"].view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
            return {"logits": model.logits(hidden.gather(1, last)), "hidden": hidden}  # [N, 1, V]

        return key, forward_fn

    out = runner.run("prefill", build, inputs, executor=runner._eager)
    return StepOutput(out["logits"], out["hidden"], span_tokens=span)

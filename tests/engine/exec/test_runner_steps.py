"""ModelRunner: buckets, padded rows that never touch a real slot, static-shape executor keys."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.exec.step_fns import EagerExecutor
from engine.exec.graphs.key import GraphKey
from engine.exec.runner import Row, switch_for_key
from engine.exec.step_buckets import pow2_bucket
from tests.engine.engine_helpers import make_engine, slot_keys

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class RecordingExecutor(EagerExecutor):
    """Eager, and remembers each step's kind, key and input shapes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def run(self, kind, key, fn, inputs, owner=None):
        self.calls.append((kind, key, {k: tuple(v.shape) for k, v in inputs.items() if hasattr(v, "shape")}))
        return fn(inputs)


def test_buckets():
    assert [pow2_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert pow2_bucket(3, lower=16) == 16
    assert switch_for_key("draft_round", GraphKey.of("b8", "k2", "L4096", switches=["SPLIT_ATTN"])) == "SPLIT_ATTN"
    assert switch_for_key("decode", GraphKey.of("b8", "L4096")) is None
    assert str(GraphKey.of("b8", "L4096", switches=["SPLIT_ATTN"])) == "(b8, L4096, split)"
    # The kernel path needs less memory than the gathering one: a failed capture never turns it off.
    assert switch_for_key("decode", GraphKey.of("b8", "L4096", switches=["PAGED_ATTN"])) is None
    assert switch_for_key("verify", GraphKey.of("b8", "k2", "L4096", switches=["SPLIT_ATTN", "PAGED_ATTN"])) \
        == "SPLIT_ATTN"


def test_paged_attn_is_degraded_quietly_where_its_kernels_cannot_run(ckpt):
    engine = make_engine(ckpt, batch=2)
    state = {s["name"]: s for s in engine.board.snapshot()}["PAGED_ATTN"]
    assert engine.kv.kernel is None and not state["enabled"] and state["degraded"]
    assert "CUDA" in state["reason"]
    key = GraphKey.of("b1", "L256")
    assert engine.runner.on_path(key, lambda x: x)[0] == key  # CPU keys unchanged
    again = engine.set_switch("PAGED_ATTN", True)  # asked for live: it cannot run here, and says why
    assert not again.enabled and again.degraded and "CUDA" in again.reason


def test_padded_rows_write_only_scratch_columns(ckpt):
    executor = RecordingExecutor()
    # every slot's own columns (reserved): by use, unmapped positions read the one scratch block padded rows write
    engine = make_engine(ckpt, batch=4, context=512, executor=executor, kv_pool="reserved")
    runner, kv = engine.runner, engine.kv
    with torch.inference_mode():
        runner.prefill(0, list(range(10, 40)), 0)
        before = [slot_keys(kv, i)[:, :, :512].clone() for i in range(len(kv.k))]
        out = runner.decode([Row(0, 5, 30), Row(1, 6, 0), Row(2, 7, 0)])  # 3 rows -> bucket 4
    assert out.logits.shape[0] == 4
    kind, key, shapes = executor.calls[-1]
    assert kind == "decode" and key == GraphKey.of("b4", "L256") and shapes["tokens"] == (4, 1)
    for layer, old in enumerate(before):
        new = slot_keys(kv, layer)[:, :, :512]
        changed = (new != old).any(dim=-1).any(dim=1).nonzero().tolist()  # [slot, position] pairs
        assert sorted(changed) == [[0, 30], [1, 0], [2, 0]]  # slot 3 and the real history untouched


def test_span_bucket_follows_the_longest_row_and_caps_at_the_context(ckpt):
    engine = make_engine(ckpt, batch=2, context=600)
    r = engine.runner
    assert r.span_bucket(1) == 256 and r.span_bucket(257) == 512 and r.span_bucket(599) == 600


def test_prompt_chunk_keys_are_static_per_bucket_unless_the_fused_chunk_path_runs_them_eagerly(ckpt):
    executor = RecordingExecutor()
    engine = make_engine(ckpt, batch=1, executor=executor, prefill_chunk_tokens=64, batch_mtp=True, mtp_depth=2)
    prompt = list(range(3, 103))  # two chunks: 64 + 36 tokens, both in the 64-token bucket
    engine.add_request("p", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_work:
        engine.step()
    keys = [(kind, key) for kind, key, _ in executor.calls]
    assert [k for k in keys if k[0] == "prefill"] == [("prefill", GraphKey.of("t64", "L256"))] * 2
    assert [k for k in keys if k[0] == "draft_prefill"] == [("draft_prefill", GraphKey.of("t64", "L256"))] * 2
    assert {"verify", "draft_round", "draft_step"} <= {kind for kind, _ in keys}

    fused_exec = RecordingExecutor()
    fused = make_engine(ckpt, batch=1, executor=fused_exec, prefill_chunk_tokens=64)
    fused.kv.fused_prefill = True  # what CUDA + flash decides
    fused.add_request("p", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while fused.has_work:
        fused.step()
    assert "prefill" not in {kind for kind, _, _ in fused_exec.calls}  # eager, keyed by ("t64", "L256", "s<start>")


def test_rows_of_very_different_lengths_decode_in_separate_forwards(ckpt):
    engine = make_engine(ckpt, batch=2, context=8192)
    r = engine.runner
    assert r.span_groups([10, 300, 2000]) == [[0, 1, 2]]  # 256..2048: within 8x
    assert r.span_groups([5000, 10, 1500]) == [[1, 2], [0]]  # 8192 is 32x the 256 bucket
    assert r.span_groups([]) == []


def test_a_long_and_a_short_slot_decode_correctly_in_separate_groups(ckpt):
    from tests.engine.engine_helpers import random_prompts, run_all, tokens_of

    executor = RecordingExecutor()
    prompts = [random_prompts(1, seed=70, lengths=(2100, 2101))[0], random_prompts(1, seed=71, lengths=(10, 11))[0]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    grouped = make_engine(ckpt, batch=2, context=4096, prefill_chunk_tokens=512, step_token_budget=1024,
                          executor=executor)
    got = tokens_of(run_all(grouped, prompts, params))
    alone = {f"r{i}": tokens_of(run_all(make_engine(ckpt, batch=1, context=4096, prefill_chunk_tokens=512,
                                                    step_token_budget=1024), [p], params))["r0"]
             for i, p in enumerate(prompts)}
    assert got == alone
    decode_keys = {key for kind, key, _ in executor.calls if kind == "decode"}
    assert GraphKey.of("b1", "L256") in decode_keys and GraphKey.of("b1", "L4096") in decode_keys


def test_paged_prefill_routes_prompt_chunks_to_the_kernel_path_only_when_on_and_keys_say_so(ckpt, monkeypatch):
    """The routing of PAGED_PREFILL, reachable without Triton: a kernel backend that records which reads it was
    handed (and answers them with the reference maths) stands in for the compiled kernels; the routing, the
    graph keys and the live toggle are the real ones."""
    import engine.exec.kv.cache as kv_cache
    from engine.model.attention.backends import TorchAttention, TritonPagedAttention
    from tests.engine.engine_helpers import random_prompts, run_all, tokens_of

    reads: list[int] = []

    class RecordingKernels(TritonPagedAttention):
        def runs_on(self, q):
            return True

        def paged(self, kv, layer, q, positions):
            reads.append(q.shape[2])
            return TorchAttention.attend(self, kv, layer, q, positions)

    prompts = random_prompts(2, seed=96, lengths=(130, 200))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    reference = tokens_of(run_all(make_engine(ckpt, batch=2), prompts, params))
    monkeypatch.setattr(kv_cache, "kernel_backend", lambda device: RecordingKernels())
    executor = RecordingExecutor()
    engine = make_engine(ckpt, batch=2, executor=executor, switches={"PAGED_PREFILL": False})
    assert tokens_of(run_all(engine, prompts, params)) == reference
    assert reads and max(reads) <= 8, "PAGED_PREFILL off: chunks take the reference"
    chunk_keys = [key for kind, key, _ in executor.calls if key.runs_chunks]
    assert chunk_keys and not any(key.depends_on("PAGED_PREFILL") for key in chunk_keys)

    reads.clear()
    executor.calls.clear()
    assert engine.set_switch("PAGED_PREFILL", True).enabled  # live
    assert tokens_of(run_all(engine, prompts, params)) == reference
    assert max(reads) > 8, "the chunks went through the kernel path"
    for kind, key, _ in executor.calls:
        assert key.depends_on("PAGED_PREFILL") is key.runs_chunks, (kind, key)  # decode graphs are kept
    assert switch_for_key("prefill", GraphKey.of("t64", "L256", switches=["PAGED_ATTN", "PAGED_PREFILL"])) is None


def test_paged_prefill_is_unavailable_where_the_kernels_cannot_run(ckpt):
    engine = make_engine(ckpt, batch=2, switches={"PAGED_PREFILL": True})
    state = {s["name"]: s for s in engine.board.snapshot()}["PAGED_PREFILL"]
    assert not state["enabled"] and state["degraded"] and "CUDA" in state["reason"]


def test_short_prompt_chunks_replay_their_bucket_from_its_second_sight(ckpt, monkeypatch):
    """Where the prompt-chunk kernel runs (PAGED_ATTN and PAGED_PREFILL on CUDA, stood in for here: on CPU the
    reference backend computes the same chunk), a short chunk needs no start baked in, so it goes to the graph
    executor keyed by its (tokens, span) bucket alone; the first chunk of a bucket runs eagerly (a capture costs a
    few eager runs, and an odd prompt length may never come back). On a GPU the graph replays (test_engine_gpu)."""
    executor = RecordingExecutor()
    engine = make_engine(ckpt, batch=2, context=2048, executor=executor)
    runner = engine.runner
    enabled = runner.board.enabled
    monkeypatch.setattr(runner, "paged_enabled", lambda: True)
    monkeypatch.setattr(runner.board, "enabled", lambda name: name == "PAGED_PREFILL" or enabled(name))
    eager: list[tuple[str, GraphKey]] = []

    def run_eagerly(kind, key, fn, inputs, owner=None):
        eager.append((kind, key))
        return fn(inputs)

    monkeypatch.setattr(runner._eager, "run", run_eagerly)
    with torch.inference_mode():
        for start in (0, 0, 100):  # bucket (t128, L256) twice, then (t128, L256) at another start
            runner.prefill(0, list(range(10, 110)), start)
        runner.prefill(1, list(range(10, 50)), 0)  # a new bucket (t64, L256): eager again
    to_graphs = [key for kind, key, _ in executor.calls if kind == "prefill"]
    assert [kind for kind, _ in eager] == ["prefill", "prefill"], eager
    assert len(to_graphs) == 2 and to_graphs[0] == to_graphs[1], to_graphs  # one key for both starts
    assert not any(part.startswith("s") for part in to_graphs[0].shape), to_graphs[0]


def test_a_lone_chunk_of_the_default_chunk_size_replays_its_graph_too(ckpt, monkeypatch):
    """A burst of 1K-token prompts beside decoding slots on an H100 (the engine's own timeline, random:0.6b): each
    lone 1K chunk ran as an eager forward, bound by the host's launches at several times its device time; the
    prompt pacer's fit priced every chunk at that, and the burst went one prompt a step for a second. Chunks up
    to the default chunk size (2,048) go to the graph executor from their bucket's second sight."""
    executor = RecordingExecutor()
    engine = make_engine(ckpt, batch=1, context=4096, executor=executor, prefill_chunk_tokens=2048,
                         step_token_budget=2048)
    runner = engine.runner
    assert EngineConfig(model="builtin:strata-tiny").prefill_chunk_tokens == 2048  # the default chunk
    enabled = runner.board.enabled
    monkeypatch.setattr(runner, "paged_enabled", lambda: True)
    monkeypatch.setattr(runner.board, "enabled", lambda name: name == "PAGED_PREFILL" or enabled(name))
    with torch.inference_mode():
        for length in (1000, 1000, 2048, 2048):
            runner.prefill(0, [10 + i % 90 for i in range(length)], 0)
    to_graphs = [key for kind, key, _ in executor.calls if kind == "prefill"]
    assert [key.shape[0] for key in to_graphs] == ["t1024", "t2048"], to_graphs


def test_a_chunk_beside_the_steps_always_runs_eagerly(ckpt, monkeypatch):
    """random:0.6b's mixed set at 32 concurrent on an H100 (`bench throughput --sets mixed`) ended a request with
    NonFiniteLogits in nearly every run while chunks beside the steps replayed captured graphs on the side stream,
    under either KV pool, and in none with those chunks eager. A chunk beside the steps never goes to the graph
    executor; one between the steps replays its bucket's graph from the bucket's second sight, in the steps' pool."""
    executor = RecordingExecutor()
    owners: list[str | None] = []
    run = executor.run

    def recording_run(kind, key, fn, inputs, owner=None):
        owners.append(owner)
        return run(kind, key, fn, inputs, owner)

    monkeypatch.setattr(executor, "run", recording_run)
    engine = make_engine(ckpt, batch=2, context=2048, executor=executor, prefill_overlap="on")
    runner = engine.runner
    enabled = runner.board.enabled
    monkeypatch.setattr(runner, "paged_enabled", lambda: True)
    monkeypatch.setattr(runner.board, "enabled", lambda name: name == "PAGED_PREFILL" or enabled(name))
    with torch.inference_mode():
        for beside in (True, True, True, False, False, True):  # one bucket, (t128, L256), on either side
            runner.prefill(0, list(range(10, 110)), 0, beside=beside)
    calls = [(key, owner) for (kind, key, _), owner in zip(executor.calls, owners) if kind == "prefill"]
    assert len(calls) == 1, calls  # the second chunk between the steps; no chunk beside them, however often seen
    [(key, owner)] = calls
    assert key.shape[:2] == ("t128", "L256") and owner is None


@pytest.mark.parametrize("size, tokens", [("0.6b", 2048), ("tiny", 2048), ("8b", 512), ("moe-tiny", 512)])
def test_only_small_dense_models_replay_lone_chunks_past_512_tokens(size, tokens):
    """The lone 1K chunk was measured host-bound on the 0.6B shape; larger and MoE models keep the 512 of before."""
    from engine.exec.runner import graph_chunk_tokens
    from engine.model.causal_lm import CausalLM
    from engine.model.random_checkpoint import random_config

    with torch.device("meta"):
        model = CausalLM(random_config(size=size))
    assert graph_chunk_tokens(model) == tokens


@pytest.mark.parametrize("batch_mtp", [False, True])
def test_on_the_kernel_path_few_query_steps_take_one_key_per_batch_as_contexts_grow(ckpt, monkeypatch, batch_mtp):
    """Where the paged kernels run, a row reads and splits only its own keys, so decode, verify and the drafter's
    rounds and chain steps are built for the whole context: as the slots' contexts cross length buckets, no new
    key (on a GPU: no capture stalling the slots, no kernel compiled). The kernel backend is stood in, as above:
    it records the span it is handed and answers with the reference maths; tokens are the reference engine's.
    Prompt chunks keep their length buckets (their kernel plans by the span)."""
    import engine.exec.kv.cache as kv_cache
    from engine.model.attention.backends import TorchAttention, TritonPagedAttention
    from tests.engine.engine_helpers import random_prompts, run_all, tokens_of

    spans: set[int] = set()

    class RecordingKernels(TritonPagedAttention):
        def runs_on(self, q):
            return True

        def paged(self, kv, layer, q, positions):
            if q.shape[2] <= 8:  # a few-query step (with PAGED_PREFILL on, prompt chunks come here too)
                spans.add(kv.span_tokens)
            return TorchAttention.attend(self, kv, layer, q, positions)

    prompts = random_prompts(2, seed=97, lengths=(240, 250))  # decoding crosses the 256-token bucket
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference_executor = RecordingExecutor()
    reference = tokens_of(run_all(make_engine(ckpt, batch=2, batch_mtp=batch_mtp, mtp_depth=2,
                                              executor=reference_executor),
                                  prompts, params))
    steps = ("decode", "verify", "draft_round", "draft_step")
    reference_spans = {key.shape[-1] for kind, key, _ in reference_executor.calls if kind in steps}
    assert {"L256", "L512"} <= reference_spans, reference_spans  # the reference path: length buckets

    monkeypatch.setattr(kv_cache, "kernel_backend", lambda device: RecordingKernels())
    executor = RecordingExecutor()
    engine = make_engine(ckpt, batch=2, batch_mtp=batch_mtp, mtp_depth=2, executor=executor)
    engine.runner._eager = executor  # both prompts' chunks as rows of one forward run on the eager executor
    assert tokens_of(run_all(engine, prompts, params)) == reference
    step_keys = {(kind, key) for kind, key, _ in executor.calls if kind in steps}
    assert step_keys and {key.shape[-1] for _, key in step_keys} == {"L1024"}, step_keys  # the context
    assert len({(kind, key.shape[0]) for kind, key in step_keys}) == len(step_keys)  # one key per kind and batch
    assert spans == {1024}, spans  # each kernel call was handed the whole context
    chunk_spans = {key.shape[-1] for kind, key, _ in executor.calls if key.runs_chunks}
    assert "L256" in chunk_spans, chunk_spans


def test_a_chunk_deep_in_a_long_context_reads_its_prefix_not_the_whole_context(ckpt):
    """A 1,024-token chunk at 8K of a 16K context: the reference reads the cached prefix and the chunk, rounded
    up to a fine bucket, never the whole context (with the power-of-two bucket it read all 16K keys and cost
    five times the chunk before it on a CPU)."""
    executor = RecordingExecutor()
    engine = make_engine(ckpt, batch=1, context=16384, prefill_chunk_tokens=1024, step_token_budget=2048,
                         executor=executor)
    runner = engine.runner
    end = 8192 + 1024
    with torch.inference_mode():
        out = runner.prefill(0, [7] * 1024, 8192)
    assert end <= out.span_tokens <= end * 1.125, out.span_tokens
    assert out.span_tokens < 16384
    _, key, _ = executor.calls[-1]
    assert f"L{out.span_tokens}" in str(key)
    # every end gets a span that holds it, within an eighth of its power-of-two bucket
    for end_tokens in (1, 255, 257, 1000, 4097, 8193, 9216, 12000, 16384):
        span = runner.chunk_span(end_tokens)
        assert end_tokens <= span <= max(256, pow2_bucket(end_tokens)) and span <= 16384
        assert span - end_tokens < max(256, pow2_bucket(end_tokens) // 8)
    assert runner.chunk_span(9216) in runner.chunk_spans()
    engine.close()

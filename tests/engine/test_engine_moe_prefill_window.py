"""A long prompt on an MoE model whose experts do not all fit the expert cache (CPU, the synthetic skewed model):
the prompt's chunks run layer by layer over a window (engine/exec/prefill_window.py), so each cold expert is
copied to its layer's pool once per window, not once per chunk; the expert cache counts the copies per layer
and the prompt steps' share (`layers[i].prompt_loaded`, `prompt_loaded_mib`); and the tokens are the
chunk-by-chunk run's, greedy, with short requests decoding beside the long one and with MTP drafting."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.errors import ConfigError
from tests.engine.engine_helpers import make_engine, one_thread, random_prompts, run_all, small_config, tokens_of

MODEL = "random:moe-synth-tiny"  # 3 sparse layers + an MTP one, 16 experts (top-2) each
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CHUNK_TOKENS = 16
LONG_TOKENS = 160  # ten chunks
CACHE_MIB = 1  # 9 slots of 16 experts a layer: a chunk's routed experts do not stay resident for the next


def _long_prompt() -> list[int]:
    return random_prompts(1, seed=11, lengths=(LONG_TOKENS, LONG_TOKENS + 1))[0]


def _run(prompts: list[list[int]], fused: bool = False, **kw):
    """Greedy tokens, the cache's snapshot, and each main layer's distinct experts routed by prompt steps
    (`fused`: chunks bound for the fused causal attention, as on CUDA)."""
    kw.setdefault("expert_cache_mib", CACHE_MIB)
    with one_thread():
        engine = make_engine(MODEL, batch=3, prefill_chunk_tokens=CHUNK_TOKENS, step_token_budget=CHUNK_TOKENS,
                             **kw)
        engine.kv.fused_prefill = True if fused else None
        cache = engine.lm.model.expert_provider
        try:
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
            routed: dict[int, set[int]] = {}
            for access in cache.stats.trace:
                if access.kind == "prefill" and access.layer < cache.main_layers:
                    routed.setdefault(access.layer, set()).update(access.experts)
            return tokens, cache.snapshot(), routed, cache.main_layers
        finally:
            engine.close()


@pytest.fixture(scope="module")
def chunk_by_chunk():
    return _run([_long_prompt()], prefill_window_tokens=0)


def test_a_cold_expert_crosses_once_per_prompt_and_layer(chunk_by_chunk):
    tokens, snap, routed, main_layers = _run([_long_prompt()])  # the default window covers the whole prompt
    assert snap.slots < snap.num_experts and snap.misses > 0
    for layer in range(main_layers):
        # the cache starts empty: every expert the prompt routes to is cold once, and copied in once
        assert 0 < snap.layers[layer].prompt_loaded <= len(routed[layer]), (layer, snap.layers[layer], routed[layer])
    assert snap.prompt_loaded_mib == pytest.approx(snap.prompt_loaded_experts * snap.expert_mib, abs=1e-2)
    assert tokens == chunk_by_chunk[0]


def test_chunk_by_chunk_copies_a_cold_expert_once_per_chunk(chunk_by_chunk):
    """What the counter shows without the window: the same routing costs several crossings per expert."""
    _, snap, routed, main_layers = chunk_by_chunk
    assert all(layer.loaded >= layer.prompt_loaded for layer in snap.layers)
    assert sum(snap.layers[i].prompt_loaded for i in range(main_layers)) > \
        2 * sum(len(routed[i]) for i in range(main_layers))


def test_windows_smaller_than_the_prompt_copy_once_per_window(chunk_by_chunk):
    window = 4 * CHUNK_TOKENS
    tokens, snap, routed, main_layers = _run([_long_prompt()], prefill_window_tokens=window)
    windows = -(-LONG_TOKENS // window)
    for layer in range(main_layers):
        assert snap.layers[layer].prompt_loaded <= windows * len(routed[layer])
    assert sum(snap.layers[i].prompt_loaded for i in range(main_layers)) < \
        sum(chunk_by_chunk[1].layers[i].prompt_loaded for i in range(main_layers))
    assert tokens == chunk_by_chunk[0]


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_window_beside_decoding_slots_gives_the_chunk_by_chunk_tokens(mtp):
    # two short prompts admitted with the long one decode while its chunks (its windows) run
    prompts = [_long_prompt()] + random_prompts(2, seed=12, lengths=(6, 12))
    extra = {"batch_mtp": True, "mtp_depth": 2} if mtp else {}
    plain, chunked, _, _ = _run(prompts, prefill_window_tokens=0, **extra)
    windowed, snap, _, _ = _run(prompts, prefill_window_tokens=3 * CHUNK_TOKENS, **extra)
    assert windowed == plain
    assert snap.prompt_loaded_experts < chunked.prompt_loaded_experts
    assert len({tuple(t) for t in plain.values()}) == 3


def test_window_with_the_fused_chunk_attention_gives_the_chunk_by_chunk_tokens():
    plain, _, _, _ = _run([_long_prompt()], fused=True, prefill_window_tokens=0)
    windowed, snap, routed, main_layers = _run([_long_prompt()], fused=True)
    assert windowed == plain
    assert all(snap.layers[i].prompt_loaded <= len(routed[i]) for i in range(main_layers))


def test_all_resident_runs_chunk_by_chunk():
    """Every expert on the device: nothing can be cold, so no window runs (the chunk path keeps its graphs)."""
    with one_thread():
        engine = make_engine(MODEL, batch=1, prefill_chunk_tokens=CHUNK_TOKENS, step_token_budget=CHUNK_TOKENS)
        try:
            run_all(engine, [_long_prompt()], GREEDY)
            assert engine.lm.model.expert_provider.every_expert_resident
            assert engine.executor.window.windows == 0
        finally:
            engine.close()


def test_a_negative_window_is_refused_naming_the_option():
    with pytest.raises(ConfigError, match="prefill_window_tokens"):
        small_config(MODEL, prefill_window_tokens=-1)


def test_chunks_beside_the_steps_are_refused_for_moe_naming_the_window():
    """--prefill-overlap on would run chunks on a side stream while the slots decode through the same expert
    pools: refused by name, pointing at what an MoE model's long prompts do instead."""
    with one_thread(), pytest.raises(ConfigError, match="prefill_overlap") as err:
        make_engine(MODEL, batch=1, prefill_overlap="on", expert_cache_mib=CACHE_MIB)
    assert "--prefill-window-tokens" in str(err.value)


def test_an_aborted_prompt_leaves_no_window_behind():
    """A prompt aborted after its window ran: a new prompt under the same request id in the same slot computes
    its own window (the aborted one's hidden states went with it), giving a fresh engine's tokens."""
    first, second = _long_prompt(), random_prompts(1, seed=13, lengths=(LONG_TOKENS, LONG_TOKENS + 1))[0]
    with one_thread():
        engine = make_engine(MODEL, batch=1, prefill_chunk_tokens=CHUNK_TOKENS, step_token_budget=CHUNK_TOKENS,
                             expert_cache_mib=CACHE_MIB)
        try:
            engine.add_request("r0", first, GREEDY)
            engine.step()  # the first chunk: its window covers the whole prompt
            assert engine.executor.window.windows == 1
            engine.abort("r0")
            reused = tokens_of(run_all(engine, [second], GREEDY, prefix="r"))
            assert engine.executor.window.windows == 2
        finally:
            engine.close()
    fresh, _, _, _ = _run([second], prefill_window_tokens=0)
    assert reused["r0"] == fresh["r0"]


def test_decoding_slots_keep_their_steps_while_windows_run():
    """A long prompt arriving while two slots decode: no engine step runs a whole window of prompt work (the
    windows ramp up from one chunk and the next one is computed in slices beside the served chunks), the slots
    decode in every step, and the tokens and the crossings beat chunk by chunk as before."""
    shorts = random_prompts(2, seed=12, lengths=(6, 12))
    long_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    short_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def run(window_tokens: int):
        with one_thread():
            engine = make_engine(MODEL, batch=3, prefill_chunk_tokens=CHUNK_TOKENS, step_token_budget=CHUNK_TOKENS,
                                 expert_cache_mib=CACHE_MIB, prefill_window_tokens=window_tokens)
            cache = engine.lm.model.expert_provider
            tokens: dict[str, list[int]] = {}
            prompt_rows, seen = [], 0
            try:
                for i, prompt in enumerate(shorts):
                    engine.add_request(f"s{i}", prompt, short_params)
                while engine.sched.num_decoding < 2:  # both shorts decode before the long prompt comes
                    for out in engine.step():
                        tokens.setdefault(out.request_id, []).extend(out.token_ids)
                seen = len(cache.stats.trace)
                engine.add_request("long", _long_prompt(), long_params)
                while engine.has_work:
                    for out in engine.step():
                        tokens.setdefault(out.request_id, []).extend(out.token_ids)
                    trace = list(cache.stats.trace)[seen:]
                    seen += len(trace)
                    if any(a.kind == "decode" for a in trace):  # a step in which the slots decoded
                        prompt_rows.append(sum(a.tokens for a in trace
                                               if a.kind == "prefill" and a.layer < cache.main_layers))
                return tokens, cache.snapshot(), prompt_rows, cache.main_layers
            finally:
                engine.close()

    plain, chunked, chunk_rows, main_layers = run(0)
    windowed, snap, window_rows, _ = run(16384)
    assert windowed == plain and len(plain["long"]) == 4
    chunk_work = CHUNK_TOKENS * main_layers  # one chunk through every layer
    assert max(chunk_rows) <= chunk_work
    # at most three chunks' worth in one step (the first: its chunk and the next window of two), never the
    # whole prompt's ten
    assert sum(window_rows) >= LONG_TOKENS * main_layers and max(window_rows) <= 3 * chunk_work
    assert snap.prompt_loaded_experts < chunked.prompt_loaded_experts


def test_two_long_prompts_in_one_step_each_run_through_their_window():
    """Two long prompts admitted together, the step budget holding a chunk of each: chunks a window serves never
    go into a shared forward of several prompts' chunks (engine.exec.chunk_rows), which would copy each cold
    expert once per chunk again; the tokens are the chunk-by-chunk run's."""
    prompts = random_prompts(2, seed=12, lengths=(LONG_TOKENS, LONG_TOKENS + 1))
    with one_thread():
        engine = make_engine(MODEL, batch=2, prefill_chunk_tokens=CHUNK_TOKENS, step_token_budget=2 * CHUNK_TOKENS,
                             expert_cache_mib=CACHE_MIB)
        try:
            tokens = tokens_of(run_all(engine, prompts, GREEDY))
            assert engine.executor.window.windows == 2  # one window each, the whole prompt
            snap = engine.lm.model.expert_provider.snapshot()
        finally:
            engine.close()
        apart = make_engine(MODEL, batch=2, prefill_chunk_tokens=CHUNK_TOKENS, step_token_budget=2 * CHUNK_TOKENS,
                            expert_cache_mib=CACHE_MIB, prefill_window_tokens=0)
        try:
            assert tokens == tokens_of(run_all(apart, prompts, GREEDY))
            chunked = apart.lm.model.expert_provider.snapshot()
        finally:
            apart.close()
    assert snap.prompt_loaded_experts < chunked.prompt_loaded_experts

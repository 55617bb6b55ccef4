"""Engine on CPU: greedy and sampled generation with slots and chunked prefill, checked against a plain
greedy loop over the model layer's DenseKVCache (an independent KV implementation)."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.errors import ConfigError, MaxTokensTooLarge, PromptTooLong, RequestRejected
from engine.telemetry import EventBus
from tests.engine.engine_helpers import make_engine, small_config as small_config_for, random_prompts, run_all, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _dense_greedy(ckpt, prompt: list[int], n: int) -> list[int]:
    from engine.model import load_checkpoint
    from tests.engine.model.dense_kv import DenseKVCache

    lm = load_checkpoint(ckpt, dtype="float32", device="cpu", tokenizer=False)
    kv = DenseKVCache.for_config(lm.config, 1, len(prompt) + n + 1)
    with torch.inference_mode():
        h = lm.model(torch.tensor([prompt]), torch.arange(len(prompt)).view(1, -1), kv)
        out = [int(lm.model.logits(h)[0, -1].argmax())]
        for i in range(n - 1):
            pos = torch.tensor([[len(prompt) + i]])
            h = lm.model(torch.tensor([[out[-1]]]), pos, kv)
            out.append(int(lm.model.logits(h)[0, -1].argmax()))
    return out


def test_greedy_matches_a_plain_dense_loop_across_batch_sizes_and_chunks(ckpt):
    prompts = random_prompts(6, seed=3, lengths=(5, 150))
    reference = {f"r{i}": _dense_greedy(ckpt, p, GREEDY.max_tokens) for i, p in enumerate(prompts)}
    assert len({tuple(v) for v in reference.values()}) == len(prompts)  # the model is not degenerate
    for batch in (1, 4):
        got = tokens_of(run_all(make_engine(ckpt, batch=batch), prompts, GREEDY))
        assert got == reference, f"batch {batch}"


def test_sampled_generation_is_reproducible_per_seed_and_varies_across_seeds(ckpt):
    prompt = random_prompts(1, seed=4)[0]
    engine = make_engine(ckpt, batch=4)
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    for i, p in enumerate(params):
        engine.add_request(f"s{i}", prompt, p)
    outs: dict[str, list[int]] = {}
    while engine.has_work:
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    assert outs["s0"] == outs["s1"]
    assert outs["s0"] != outs["s2"]
    assert all(len(v) == 12 for v in outs.values())


def test_outputs_are_increments_with_text_and_usage(ckpt):
    engine = make_engine(ckpt, batch=2)
    outs = run_all(engine, random_prompts(2, seed=5), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    for rid, seq in outs.items():
        assert [o.finished for o in seq] == [False] * (len(seq) - 1) + [True]
        assert seq[-1].finish_reason == "length" and seq[-1].completion_tokens == 9
        ids = [t for o in seq for t in o.token_ids]
        assert "".join(o.text for o in seq) == engine.tokenizer.decode(ids)


def test_stop_string_cuts_text_and_finishes(ckpt):
    prompt = random_prompts(1, seed=6)[0]
    engine = make_engine(ckpt, batch=1)
    full = run_all(engine, [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))["r0"]
    text = "".join(o.text for o in full)
    assert len(text) >= 8
    stop = text[5:8]
    cut = run_all(engine, [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,)),
                  prefix="c")["c0"]
    assert cut[-1].finish_reason == "stop"
    assert "".join(o.text for o in cut) == text[: text.index(stop)]


def test_stop_token_ids_finish_with_stop(ckpt):
    prompt = random_prompts(1, seed=7)[0]
    engine = make_engine(ckpt, batch=1)
    free = tokens_of(run_all(engine, [prompt], GREEDY))["r0"]
    stop_id = free[4]
    first = free.index(stop_id)
    outs = run_all(engine, [prompt], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(stop_id,)), prefix="t")
    assert outs["t0"][-1].finish_reason == "stop"
    assert tokens_of(outs)["t0"] == free[: first + 1]


def test_long_prompt_prefill_is_interleaved_with_other_slots_decode(ckpt):
    """A long prompt is prefilled a chunk per step while the decoding slots keep producing tokens."""
    engine = make_engine(ckpt, batch=3, prefill_chunk_tokens=32, step_token_budget=40, context=1024)
    short = random_prompts(2, seed=8, lengths=(10, 20))
    for i, p in enumerate(short):  # enough tokens to outlast the long prefill however the pacer spreads it
        engine.add_request(f"d{i}", p, SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    long_prompt = random_prompts(1, seed=9, lengths=(600, 601))[0]
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    long_req = engine.sched.get("long")
    chunk_steps = 0
    while long_req.num_output_tokens == 0:
        before = long_req.num_computed_tokens
        outs = engine.step()
        if long_req.num_computed_tokens > before:  # a chunk of the long prompt ran in this step ...
            chunk_steps += 1
            decoded = {o.request_id for o in outs if o.token_ids}
            assert {"d0", "d1"} <= decoded, f"step with a chunk but no decode for {({'d0', 'd1'} - decoded)}"
    assert chunk_steps >= 600 // 32  # ... and the prompt took many chunks


def test_abort_frees_the_slot_and_reports_abort(ckpt):
    engine = make_engine(ckpt, batch=1)
    engine.add_request("a", random_prompts(1, seed=10)[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.add_request("b", random_prompts(1, seed=11)[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    final = engine.abort("a")
    assert final is not None and final.finished and final.finish_reason == "abort"
    assert engine.abort("a") is None
    outs = run_all(engine, [], GREEDY)
    assert not engine.has_work


def test_requests_that_cannot_fit_are_rejected_with_the_numbers(ckpt):
    engine = make_engine(ckpt, batch=1, context=256, prefill_chunk_tokens=64)
    with pytest.raises(PromptTooLong, match="257 tokens"):
        engine.add_request("x", [5] * 257, GREEDY)
    with pytest.raises(MaxTokensTooLarge):
        engine.add_request("y", [5] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="token id 512 is outside") as info:
        engine.add_request("z", [5, 512], SamplingParams(max_tokens=4))
    assert info.value.param == "prompt"
    assert not engine.has_work


def test_a_kv_cache_that_cannot_fit_is_a_config_error_naming_mib(ckpt):
    with pytest.raises(ConfigError, match=r"MiB") as info:
        make_engine(ckpt, batch=256, context=262144, prefill_chunk_tokens=64, vram_reserve_mib=0, kv_pool="reserved")
    assert info.value.param == "context"
    assert "needs" in str(info.value) and "available" in str(info.value)
    # by use (the default) the context is a per-request limit: the same config starts with a small pool
    engine = make_engine(ckpt, batch=256, context=262144, prefill_chunk_tokens=64, vram_reserve_mib=0)
    assert engine.kv.paging is not None and engine.kv.mib < 257  # CPU_START_POOL_MIB and the scratch block


def test_generate_text_returns_text_and_stats(ckpt):
    from engine.orchestration.generate import generate_text

    text, stats = generate_text(small_config_for(ckpt), "hello world", SamplingParams(max_tokens=6, temperature=0.0,
                                                                                     ignore_eos=True))
    assert stats["completion_tokens"] == 6 and stats["finish_reason"] == "length"
    assert stats["prompt_tokens"] > 0 and isinstance(text, str) and text


def test_batch_mtp_on_a_checkpoint_without_an_mtp_head_is_a_config_error(make_checkpoint):
    plain = make_checkpoint(arch="qwen3")
    with pytest.raises(ConfigError, match="no MTP head") as info:
        make_engine(plain, batch=1, batch_mtp=True)
    assert info.value.param == "batch_mtp"


def test_fused_chunk_attention_gives_the_same_tokens_as_the_default_path(ckpt):
    """The CUDA prefill path (bottom-right-aligned fused causal attention over the chunk), forced on CPU."""
    prompts = random_prompts(3, seed=12, lengths=(70, 200))
    plain = tokens_of(run_all(make_engine(ckpt, batch=3), prompts, GREEDY))
    fused = make_engine(ckpt, batch=3, batch_mtp=True, mtp_depth=2)
    fused.kv.fused_prefill = True
    assert tokens_of(run_all(fused, prompts, GREEDY)) == plain


def test_a_stop_string_ends_its_request_like_an_abort_in_the_step_that_found_it(ckpt):
    """Stop strings are found where outputs are delivered, after the scheduler kept the step's tokens: the hit
    still ends the request in that very step (its slot free, the slot's idle event out), with the reason "stop"
    (not "abort": its prompt's cached blocks stay in the prefix tier)."""
    prompt = random_prompts(1, seed=6)[0]
    bus = EventBus(history=5000)
    engine = make_engine(ckpt, batch=1, bus=bus)
    full = run_all(engine, [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))["r0"]
    text = "".join(o.text for o in full)
    req = engine.add_request("cut", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                           stop=(text[5:8],)))
    while True:
        before = len(bus.history())
        outs = engine.step()
        if any(o.finished for o in outs):
            break
    assert [o.finish_reason for o in outs if o.finished] == ["stop"]
    assert req.finish_reason == "stop" and engine.sched.slot_request(0) is None and not engine.has_work
    assert any(e.type == "slot" and e.state == "idle" for e in bus.history()[before:])

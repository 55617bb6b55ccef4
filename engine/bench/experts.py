"""`strata-engine bench experts`: decode tok/s and expert hit rate of a Qwen3-MoE model per expert-cache budget.

Budgets are percentages of the routed experts' bytes: each becomes `--expert-cache-mib` for that many slots
per sparse layer (rounded to whole slots, at least one); 100 % is the all-resident run (no budget given), the
row every other one is compared with. One engine per budget, the same prompts: a warm-up generation (it also
captures the graph buckets), then the timed one. Greedy, so every budget must emit the all-resident tokens
(`same_tokens`). Per row: the live hit rate and the Belady oracle on the same routing trace (both runs, from
a cold cache; `policy` is lru, or lfu with STRATA_EXPERT_LFU=1), and for the timed run: misses, extra graph
replays and eager re-runs after a miss, MiB copied and their copy ms, and the MiB the prompt steps copied per
prompt (`prompt_loaded_mib`: a long prompt's chunks run in layer-major windows, engine.exec.prefill_window, so a
cold expert crosses once per window and layer; `--prefill-window-tokens 0` measures chunk by chunk, and a prompt
of several chunks, `--prompt-tokens 16384`, shows the difference); `vs_belady` is the live hit rate over the
oracle's. `--hf` adds transformers'
Qwen3MoeForCausalLM `generate` (eager) on the same weights and prompts.

Random weights route near-uniformly: every expert is about equally likely for every token, so the hit rate of a
budget of p % is close to p % and says little about trained models, whose routing is skewed (much higher hit
rates at small budgets). A synthetic source (`--model random:moe-80b`, engine.model.synthetic) routes by a seeded
Zipf prior that drifts with position, so its hit rates and `vs_belady` mean something. `--trace-out` records the
smallest budget's routing trace (engine.exec.experts.trace) so a real model's trace can be replayed against the
policy offline (`bench experts-replay --trace`).

`--cold copy,cpu,prefetch` measures every budget below 100 % once per cold-expert mode (engine.exec.experts.cold:
the EXPERT_CPU and EXPERT_PREFETCH switches), side by side in one run; `--batches 1,6` repeats the table per
batch size; `--all-resident-model random:moe-80b-40l` takes the 100 % row from a model whose experts all fit
the card (random:moe-80b's do not), so `vs_all_resident` compares ~85 % on the card with all of them. Under
prefetch the experts copied in ahead of their layer are not accesses of the trace, so the live hit rate can
pass the oracle's (`vs_belady` > 1); `prefetched` counts them.

`--stores host,peer` (with `--peer-device cuda:N`) measures every budget below 100 % twice: the experts that do
not fit the compute card in pinned host memory (`store` host, no peer device: the tier stays on the compute
card too), then on the peer card (`store` peer: a miss copies peer -> compute; the prefix tier also moves to
the peer, as `--peer-device` does in serve). The all-resident row is measured once (the store is never read).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from engine.bench.common import checkpoint_dtype, device_of, emit, prepare_model, random_prompt, save_partial
from engine.bench.engine_driver import build_engine, generate_all
from engine.errors import ConfigError

_CONTEXT_MARGIN_TOKENS = 64
COLUMNS = ("engine", "model", "batch", "store", "cold", "policy", "budget_pct", "slots", "expert_cache_mib",
           "decode_tok_s", "floor_tok_s", "of_floor", "tok_s", "vs_all_resident", "hit_rate", "oracle_hit_rate",
           "vs_belady", "misses", "replays", "reruns", "loaded_mib", "prompt_loaded_mib", "load_ms", "same_tokens",
           "error")


def cold_list(text: str) -> list[str]:
    """`copy,cpu,prefetch` -> the cold-expert modes to measure (engine.exec.experts.cold), each once."""
    from engine.exec.experts.cold import COLD_MODES

    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in COLD_MODES for m in modes):
        raise ConfigError("cold", text, f"expected comma-separated {', '.join(COLD_MODES)}")
    return list(dict.fromkeys(modes))


def cold_switches(mode: str) -> dict[str, bool]:
    """The switches that select a cold-expert mode (both off: copy)."""
    from engine.exec.experts.cold import CPU_SWITCH, PREFETCH_SWITCH

    return {CPU_SWITCH: mode == "cpu", PREFETCH_SWITCH: mode == "prefetch"}


def budget_list(text: str) -> list[int]:
    """`5,15,30,50,100` -> [5, 15, 30, 50, 100]; each must be 1..100."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError("budgets", text, "expected comma-separated whole percentages 1..100") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise ConfigError("budgets", text, "expected comma-separated whole percentages 1..100")
    return sorted(set(values), reverse=True)


def slots_for_pct(pct: int, num_experts: int) -> int:
    return max(1, min(num_experts, round(num_experts * pct / 100)))


def store_list(text: str, peer_device: str | None) -> list[str]:
    """`host,peer` -> ["host", "peer"]; peer needs --peer-device."""
    stores = [s.strip() for s in text.split(",") if s.strip()]
    if not stores or any(s not in ("host", "peer") for s in stores):
        raise ConfigError("stores", text, "expected comma-separated host, peer")
    if "peer" in stores and peer_device is None:
        raise ConfigError("stores", text, "the peer store needs --peer-device cuda:N (a second GPU)")
    return list(dict.fromkeys(stores))


def step_floor_tok_s(model: Any, cache: Any, first_step: int, batch: int, bandwidth_gb_s: float) -> float | None:
    """The bandwidth floor of the decode steps since `first_step`: a step reads every dense weight once (the
    embedding only a row a token, the MTP head not at all) and each distinct expert its tokens routed to once,
    so `batch` tokens a step can come no faster than bandwidth / those bytes (the KV of these short prompts is
    left out). The distinct experts are the steps' own, from the cache's routing trace."""
    dense = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                if not name.startswith(("embed_tokens", "mtp.")))
    per_step: dict[int, int] = {}
    for a in cache.stats.trace:
        if a.step >= first_step and a.kind == "decode" and a.layer < cache.main_layers:
            per_step[a.step] = per_step.get(a.step, 0) + len(a.experts)
    if not per_step:
        return None
    expert_bytes = cache.expert_mib * 2**20
    step_bytes = dense + expert_bytes * sum(per_step.values()) / len(per_step)
    return batch * bandwidth_gb_s * 1e9 / step_bytes


def measure_budget(args: argparse.Namespace, path: str, pct: int, prompts: list[list[int]],
                   warmup: list[list[int]], layer_mib: float, num_experts: int,
                   store: str = "host", cold: str = "copy",
                   bandwidth_gb_s: float | None = None) -> tuple[dict[str, Any], Any]:
    """One engine at `pct` % of the expert bytes, its store on the host or the --peer-device, its misses served
    by the `cold` mode: its row and the cache (for the trace)."""
    slots = slots_for_pct(pct, num_experts)
    # +1 slot: each layer's miss slot; ceil keeps the MiB whole without adding a slot (a slot is >> 1 MiB/L)
    mib = None if slots >= num_experts else math.ceil((slots + 1) * layer_mib)
    bench = build_engine(args, model=path, batch=len(prompts), expert_cache_mib=mib,
                         context=args.prompt_tokens + args.new_tokens + _CONTEXT_MARGIN_TOKENS,
                         peer_device=args.peer_device if store == "peer" else None, switches=cold_switches(cold))
    try:
        cache = bench.engine.lm.model.expert_provider
        generate_all(bench, warmup, args.new_tokens)
        m0, r0, l0, p0 = sum(cache.stats.misses), cache.stats.reruns, cache.stats.loaded_mib, cache.stats.replays
        t0, q0 = cache.stats.load_ms, cache.stats.prompt_loaded_mib
        first_step = cache.stats.steps + 1
        stats = generate_all(bench, prompts, args.new_tokens)
        floor = step_floor_tok_s(bench.engine.lm.model, cache, first_step, len(prompts), bandwidth_gb_s) \
            if bandwidth_gb_s else None
        cache.stats.publish_due(cache.mib, cache.slots, force=True, policy=cache.policy)  # times finished copies
        snap = cache.snapshot()  # hit rates over both runs from a cold cache: the oracle replays the same trace
        misses = sum(cache.stats.misses) - m0
        row = {"engine": "strata", "model": args.model, "batch": len(prompts), "store": snap.store_device,
               "cold": snap.cold,
               "policy": snap.policy, "budget_pct": pct, "prefetched": snap.prefetched,
               "slots": cache.slots,
               "expert_cache_mib": round(cache.mib, 1), "decode_tok_s": stats.decode_tok_s,
               "floor_tok_s": floor, "of_floor": stats.decode_tok_s / floor if floor and stats.decode_tok_s else None,
               "tok_s": stats.tokens / stats.wall_s, "hit_rate": snap.hit_rate,
               "oracle_hit_rate": snap.oracle_hit_rate, "lru_replay_hit_rate": snap.lru_replay_hit_rate,
               # the live policy against Belady's optimal offline choice on the same trace (1.0: as good)
               "vs_belady": (snap.hit_rate / snap.oracle_hit_rate) if snap.oracle_hit_rate else None,
               "misses": misses, "reruns": cache.stats.reruns - r0, "replays": cache.stats.replays - p0,
               "loaded_mib": round(cache.stats.loaded_mib - l0, 1), "load_ms": round(cache.stats.load_ms - t0, 1),
               # what the timed prompts' chunks copied in, per prompt (a layer-major window: once per cold expert,
               # window and layer; chunk by chunk, --prefill-window-tokens 0: once per chunk)
               "prompt_loaded_mib": round((cache.stats.prompt_loaded_mib - q0) / len(prompts), 1),
               "prefill_window_tokens": bench.engine.config.prefill_window_tokens,
               "ttft_s": max(stats.ttft_s) if stats.ttft_s else None,
               "graphs_active": bench.graphs_active, "token_ids": stats.token_ids, "error": None}
        return row, cache
    finally:
        bench.close()


def _expert_shape(config: Any, elem: int, int4: bool = False) -> tuple[float, int]:
    """(MiB of one expert as the cache holds it, sparse layers with a pool: the MTP layers' blocks are sparse
    too); elem 1: FP8 experts, with a 4-byte scale per output channel; `int4`: 4-bit codes with a scale and
    offset of `elem` bytes per group (engine.exec.experts.pool.int4_expert_bytes)."""
    from engine.exec.experts.pool import int4_expert_bytes
    from engine.model.quant.rtn import int4_group_size

    moe = config.moe
    H, I = config.hidden_size, moe.moe_intermediate_size
    if int4:
        return (int4_expert_bytes(H, I, int4_group_size(H), int4_group_size(I), elem) / 2**20,
                sum(moe.is_sparse(i, config.num_hidden_layers) for i in range(config.num_kv_layers)))
    expert_mib = (3 * H * I * elem + (4 * (2 * I + H) if elem == 1 else 0)) / 2**20
    return expert_mib, sum(moe.is_sparse(i, config.num_hidden_layers) for i in range(config.num_kv_layers))


def run(args: argparse.Namespace) -> int:
    """Per batch size: every budget (largest first: the all-resident row is the reference, from this model or
    from --all-resident-model), each cold-expert mode at the budgets below 100 %; then the transformers peer."""
    device = device_of(args.device)
    path = prepare_model(args.model, device, args.dtype)
    from engine.model.loader import model_config
    from engine.model.synthetic import is_synthetic

    config = model_config(path)
    if config.moe is None:
        raise ConfigError("model", args.model, "not a mixture-of-experts checkpoint (model_type qwen3_moe)")
    if getattr(args, "kernels", None):  # one layer's expert products per backend, no engine
        from engine.bench.experts_kernels import run_kernels

        return run_kernels(args, config, device)
    from engine.bench.peers import copy_bandwidth_gb_s

    bandwidth = copy_bandwidth_gb_s(device, args.copy_mib)  # the floor's, as `bench peers` measures it
    reference = getattr(args, "all_resident_model", None)
    reference_path = prepare_model(reference, device, args.dtype) if reference else None
    if reference_path is not None and model_config(reference_path).moe is None:
        raise ConfigError("all_resident_model", reference, "not a mixture-of-experts checkpoint")
    budgets = budget_list(args.budgets)
    if 100 not in budgets:
        budgets.insert(0, 100)
    stores = store_list(getattr(args, "stores", "host"), getattr(args, "peer_device", None))
    colds = cold_list(getattr(args, "cold", "copy"))
    batches = getattr(args, "batches", None) or [args.batch]
    runs = [(store, pct, cold) for store in stores for pct in budgets for cold in (colds if pct < 100 else ["copy"])
            if store == stores[0] or pct < 100]
    quantize = getattr(args, "quantize", "off")
    wide = 4 if checkpoint_dtype(args.dtype, device) == "float32" else 2  # a weight's (int4: a scale's) bytes
    elem = 1 if quantize == "fp8" else wide
    int4 = quantize == "int4"
    moe = config.moe
    expert_mib, sparse_layers = _expert_shape(config, elem, int4)
    layer_mib = sparse_layers * expert_mib  # one slot in every sparse layer
    rows: list[dict[str, Any]] = []
    for batch in batches:
        prompts = [random_prompt(args.prompt_tokens, config.vocab_size, seed=i) for i in range(batch)]
        warmup = [random_prompt(args.prompt_tokens, config.vocab_size, seed=100 + i) for i in range(batch)]
        reference_tokens = None
        for store, pct, cold in runs:
            if pct == 100 and reference_path is not None:
                # this model's experts do not all fit: the all-resident row is the variant whose experts do
                ref_config = model_config(reference_path)
                ref_mib, ref_layers = _expert_shape(ref_config, elem, int4)
                row, cache = measure_budget(args, reference_path, 100, prompts, warmup, ref_layers * ref_mib,
                                            ref_config.moe.num_experts, store, bandwidth_gb_s=bandwidth)
                row.pop("token_ids")
                row["model"], row["same_tokens"] = reference, None  # another model: its tokens are its own
                rows.append(row)
                save_partial(args, "experts", rows, device)
                continue
            row, cache = measure_budget(args, path, pct, prompts, warmup, layer_mib, moe.num_experts, store, cold,
                                        bandwidth)
            tokens = row.pop("token_ids")
            reference_tokens = tokens if reference_tokens is None else reference_tokens  # the first run's
            row["same_tokens"] = tokens == reference_tokens
            rows.append(row)
            if args.trace_out and pct == budgets[-1] and store == stores[0] and cold == colds[0] \
                    and batch == batches[0]:
                cache.stats.write_trace(args.trace_out, {"top_k": moe.num_experts_per_tok, "model": args.model,
                                                        "expert_mib": expert_mib, "slots": row["slots"]})
            save_partial(args, "experts", rows, device)
    _relative(rows)
    if args.hf and not is_synthetic(path):  # a synthetic source has no checkpoint for transformers to read
        rows.append(_hf_row(path, device, prompts, args))
    emit(args, "experts", rows, _summary(rows, expert_mib, sparse_layers, moe.num_experts), device, COLUMNS)
    return 0


def _relative(rows: list[dict[str, Any]]) -> None:
    """vs_all_resident: each row's decode tok/s over the all-resident row's of the same batch size."""
    for r in rows:
        base = next((b["decode_tok_s"] for b in rows if b["budget_pct"] == 100 and b["batch"] == r["batch"]), None)
        r["vs_all_resident"] = r["decode_tok_s"] / base if base and r["decode_tok_s"] else None


def _hf_row(path: str, device: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine.bench.peers import hf_generate_tok_s

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result = hf_generate_tok_s(path, device, dtype, prompts, args.new_tokens, static=False, compile_=False)
    return {"engine": "hf_eager", "budget_pct": 100, "decode_tok_s": None, "tok_s": result["tok_s"],
            "error": result["error"]}


def _summary(rows: list[dict[str, Any]], expert_mib: float, sparse_layers: int, num_experts: int) -> dict[str, Any]:
    out: dict[str, Any] = {"expert_mib": expert_mib, "sparse_layers": sparse_layers, "num_experts": num_experts,
                           "all_experts_mib": expert_mib * sparse_layers * num_experts,
                           "all_same_tokens": all(r.get("same_tokens") is not False
                                                  for r in rows if r["engine"] == "strata")}
    strata = next((r for r in rows if r["engine"] == "strata" and r["budget_pct"] == 100), None)
    hf = next((r for r in rows if r["engine"] == "hf_eager"), None)
    if strata and hf and hf.get("tok_s"):
        out["all_resident_vs_hf_eager_tok_s"] = strata["tok_s"] / hf["tok_s"]
    return out

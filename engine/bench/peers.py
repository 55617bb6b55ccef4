"""`strata-engine bench peers`: Strata against its peers, same run, same weights, same prompts.

Peers:
- `hf_eager`: Hugging Face transformers `generate` with the default dynamic cache (eager PyTorch).
- `hf_static_compile`: `generate` with `cache_implementation="static"` and torch.compile (transformers compiles
  the forward itself when the cache is static and the device is CUDA); recorded with its error if it fails.
- `floor`: the weight-bandwidth floor: a decode step must read every weight once, so batch-1 decode can be no
  faster than (device copy bandwidth) / (weight bytes). The copy bandwidth is measured in the same run with a
  large device-to-device copy, counting bytes read plus bytes written.

The figure compared is end-to-end generate throughput: batch x new tokens / wall time of one call (a
`prompt_tokens` prefill included), measured identically for Strata and each peer.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import torch

from engine.bench.common import device_of, prepare_model, random_prompt, timed, torch_env, weight_bytes
from engine.bench.report import document, print_report, write_json

TARGET_B1_TOK_S = 1500.0
TARGET_VS_HF_EAGER = 100.0
TARGET_FRACTION_OF_FLOOR = 0.40
_COPY_ITERS = 20


def copy_bandwidth_gb_s(device: torch.device, size_mib: int) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second)."""
    n_bytes = size_mib * 2**20
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)

    def copies() -> None:
        for _ in range(_COPY_ITERS):
            dst.copy_(src)

    seconds, _ = timed(device, copies)
    del src, dst
    return 2 * n_bytes * _COPY_ITERS / seconds / 1e9


def hf_generate_tok_s(path: str, device: torch.device, dtype: torch.dtype, prompts: list[list[int]],
                      new_tokens: int, static: bool, compile_: bool) -> dict[str, Any]:
    """One warm-up call, then one timed `generate` call; returns its throughput or the error it raised."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)
    kwargs: dict[str, Any] = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
        if compile_:
            from transformers.generation.configuration_utils import CompileConfig

            kwargs["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
        else:
            kwargs["disable_compile"] = True
    try:
        with torch.inference_mode():
            # compile + CUDA-graph recording happen on the first calls; only a warm call is timed
            for _ in range(2 if static and compile_ else 1):
                model.generate(input_ids, **kwargs)
            seconds, out = timed(device, lambda: model.generate(input_ids, **kwargs))
        generated = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
        return {"tok_s": generated / seconds, "wall_s": seconds, "error": None}
    except Exception as exc:  # a peer that does not work in this transformers is a result, not a crash
        return {"tok_s": None, "wall_s": None, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def strata_generate_tok_s(args: argparse.Namespace, path: str, prompts: list[list[int]]) -> dict[str, Any]:
    """The same prompts through the real Engine, timed the same way."""
    from engine.bench.engine_driver import build_engine, generate_all

    engine = build_engine(args, model=path, batch=len(prompts), graphs=args.graphs,
                          context=args.prompt_tokens + args.new_tokens + 64)
    try:
        generate_all(engine, prompts[:1], 8)  # warm-up: first-use allocations and graph captures
        stats = generate_all(engine, prompts, args.new_tokens)
        return {"tok_s": stats.tokens / stats.wall_s, "wall_s": stats.wall_s, "error": None,
                "decode_tok_s": stats.decode_tok_s}
    finally:
        engine.close()


def run(args: argparse.Namespace) -> int:
    device = device_of(args.device)
    path = prepare_model(args.model, device, args.dtype)
    from engine.model import ModelConfig
    from engine.model.loader import resolve_model_path

    config = ModelConfig.from_file(resolve_model_path(path) / "config.json")
    peer_dtype = getattr(torch, args.peer_dtype)
    w_bytes = weight_bytes(path)
    bw_gb_s = copy_bandwidth_gb_s(device, args.copy_mib)
    floor_b1_tok_s = bw_gb_s * 1e9 / w_bytes
    rows: list[dict[str, Any]] = []
    for batch in args.batches:
        prompts = [random_prompt(args.prompt_tokens, config.vocab_size, seed=i) for i in range(batch)]
        peers = {"hf_eager": (False, False)}
        if args.static_compile:
            peers["hf_static_compile" if args.compile else "hf_static"] = (True, args.compile)
        if not args.skip_strata:
            rows.append({"engine": "strata", "batch": batch, **strata_generate_tok_s(args, path, prompts)})
        for name, (static, compile_) in peers.items():
            result = hf_generate_tok_s(path, device, peer_dtype, prompts, args.new_tokens, static, compile_)
            rows.append({"engine": name, "batch": batch, **result})
        rows.append({"engine": "floor", "batch": batch, "tok_s": floor_b1_tok_s * batch, "wall_s": None,
                     "error": None})
    summary = _summary(rows, floor_b1_tok_s, bw_gb_s, w_bytes)
    params = {k: v for k, v in vars(args).items() if k not in ("func",)}
    doc = document("peers", rows, summary, torch_env(device), params)
    print_report(doc, ("engine", "batch", "tok_s", "wall_s", "decode_tok_s", "error"))
    print(f"wrote {write_json(args.json, doc)}")
    return 0


def _summary(rows: list[dict[str, Any]], floor_b1_tok_s: float, bw_gb_s: float, w_bytes: int) -> dict[str, Any]:
    def rate(engine: str, batch: int) -> float | None:
        return next((r["tok_s"] for r in rows if r["engine"] == engine and r["batch"] == batch), None)

    summary: dict[str, Any] = {"copy_bandwidth_gb_s": bw_gb_s, "weight_mib": w_bytes / 2**20,
                               "floor_b1_tok_s": floor_b1_tok_s}
    strata_b1, hf_b1 = rate("strata", 1), rate("hf_eager", 1)
    if strata_b1 is not None:
        summary["strata_b1_tok_s"] = strata_b1
        summary["strata_b1_fraction_of_floor"] = strata_b1 / floor_b1_tok_s
        summary["meets_b1_target"] = strata_b1 >= TARGET_B1_TOK_S
        summary["meets_floor_target"] = strata_b1 / floor_b1_tok_s >= TARGET_FRACTION_OF_FLOOR
        if hf_b1:
            summary["strata_vs_hf_eager_b1"] = strata_b1 / hf_b1
            summary["meets_hf_target"] = strata_b1 / hf_b1 >= TARGET_VS_HF_EAGER
    for row in rows:
        if row["engine"] not in ("strata", "floor") and row["tok_s"] is not None:
            strata = rate("strata", row["batch"])
            if strata is not None:
                summary[f"strata_vs_{row['engine']}_b{row['batch']}"] = strata / row["tok_s"]
    return summary

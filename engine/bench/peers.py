"""`strata-engine bench peers`: Strata against its peers, same run, same weights, same prompts.

Peers:
- `hf_eager`: Hugging Face transformers `generate` with the default dynamic cache (eager PyTorch).
- `hf_static_compile`: `generate` with `cache_implementation="static"` and torch.compile (transformers compiles
  the forward itself when the cache is static and the device is CUDA); recorded with its error if it fails.
- `llamacpp`: llama.cpp's `llama-server` (built by scripts/build_llama_server.sh, CUDA on a GPU machine) on the
  same weights written as GGUF (engine.bench.llamacpp_peer); recorded with its error if it fails.
- `floor`: the weight-bandwidth floor: a decode step must read every weight once, so batch-1 decode can be no
  faster than (device copy bandwidth) / (weight bytes). The copy bandwidth is measured in the same run with a
  large device-to-device copy, counting bytes read plus bytes written.

The figure compared is end-to-end generate throughput: batch x new tokens / wall time of one call (a
`prompt_tokens` prefill included), measured identically for Strata and each peer: the median of `--repeats` timed
calls after the warm-up (each row keeps every call's figure in `tok_s_runs`): one call's figure moved between
machines more than the gaps it was meant to show (docs/BENCHMARKS.md). Strata's repeats decode fresh prompts of
the same lengths, so no prefix-cache hit is timed.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any, Callable

import torch

from engine.bench.common import (device_of, emit, median_of, prepare_model, random_prompt, save_partial, timed,
                                 weight_bytes)
from engine.errors import ConfigError

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
                      new_tokens: int, static: bool, compile_: bool, repeats: int = 1,
                      phase: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Warm-up calls, then `repeats` timed `generate` calls; returns the median throughput or the error raised.
    `phase(name)` is told each part as it starts (load, each warm-up call, the timed calls), so a caller that
    has to kill a peer can say where it was."""
    phase = phase or (lambda _name: None)
    from transformers import AutoModelForCausalLM

    phase("loading the checkpoint")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    except Exception as exc:  # a checkpoint transformers cannot load is the peer's result, not a crash
        return {"tok_s": None, "wall_s": None, "error": _describe(exc)}
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
            # compile + CUDA-graph recording happen on the first calls; only warm calls are timed
            warmups = 2 if static and compile_ else 1
            for call in range(warmups):
                phase(f"warm-up call {call + 1} of {warmups}"
                      + (" (torch.compile and CUDA-graph capture)" if compile_ and call == 0 else ""))
                model.generate(input_ids, **kwargs)
            phase(f"{repeats} timed call{'s' if repeats > 1 else ''}")

            def one_call(_run: int) -> dict[str, Any]:
                seconds, out = timed(device, lambda: model.generate(input_ids, **kwargs))
                generated = (out.shape[1] - input_ids.shape[1]) * out.shape[0]
                return {"tok_s": generated / seconds, "wall_s": seconds}

            return {**median_of(repeats, one_call), "error": None}
    except Exception as exc:  # a peer that does not work in this transformers is a result, not a crash
        return {"tok_s": None, "wall_s": None, "error": _describe(exc)}
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


PEERS = ("eager", "static", "llamacpp")


def peer_names(text: str) -> set[str]:
    """`eager,static` -> {"eager", "static"}; an unknown name is a ConfigError naming it."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = names - set(PEERS)
    if unknown:
        raise ConfigError("peers", text, f"unknown peer {sorted(unknown)[0]!r}; known: {', '.join(PEERS)}")
    return names


def _describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def strata_generate_tok_s(args: argparse.Namespace, path: str, prompts: list[list[int]]) -> dict[str, Any]:
    """The same prompts through the real Engine, timed the same way."""
    from engine.bench.engine_driver import build_engine, generate_all

    engine = build_engine(args, model=path, batch=len(prompts), graphs=args.graphs,
                          context=args.prompt_tokens + args.new_tokens + 64)
    try:
        # warm-up like the peers' (two calls, as static + compile's: a short prompt chunk's graph is captured on
        # its bucket's second sight) on other prompts, so no prefix-cache hit is timed
        vocab = engine.engine.lm.config.vocab_size
        for warm in range(2):
            fresh = [random_prompt(len(p), vocab, seed=900 + 50 * warm + i) for i, p in enumerate(prompts)]
            generate_all(engine, fresh, args.new_tokens)

        def one_call(run: int) -> dict[str, Any]:  # the peers' prompts first, then fresh ones of their lengths
            batch = prompts if run == 0 else [random_prompt(len(p), vocab, seed=2000 + 100 * run + i)
                                              for i, p in enumerate(prompts)]
            stats = generate_all(engine, batch, args.new_tokens)
            # where the wall time went besides decode: until every prompt has its first token, and in how many steps
            return {"tok_s": stats.tokens / stats.wall_s, "wall_s": stats.wall_s, "decode_tok_s": stats.decode_tok_s,
                    "all_first_token_s": max(stats.ttft_s), "steps": stats.steps, "decode_steps": stats.decode_steps}

        return {**median_of(args.repeats, one_call), "error": None}
    finally:
        engine.close()


def run(args: argparse.Namespace) -> int:
    """Measure the floor, Strata and the chosen HF peers; print the table, write the JSON."""
    wanted = peer_names(args.peers)
    device = device_of(args.device)
    llama_server = _llama_server(args) if "llamacpp" in wanted else None
    path = prepare_model(args.model, device, args.dtype)
    from engine.model.loader import resolve_model_path

    gguf_file = resolve_model_path(path) if resolve_model_path(path).is_file() else None
    vocab = _vocab_size(path)
    w_bytes = weight_bytes(path)
    bw_gb_s = copy_bandwidth_gb_s(device, args.copy_mib)
    floor_b1_tok_s = bw_gb_s * 1e9 / w_bytes
    prompts = {b: [random_prompt(args.prompt_tokens, vocab, seed=i) for i in range(b)] for b in args.batches}
    rows: list[dict[str, Any]] = [{"engine": "floor", "batch": b, "tok_s": floor_b1_tok_s * b, "wall_s": None,
                                   "error": None} for b in args.batches]
    # Cheapest and most important first, the torch.compile peer last: a time limit cuts the least.
    if not args.skip_strata:
        for batch in args.batches:
            rows.append({"engine": "strata", "batch": batch, **strata_generate_tok_s(args, path, prompts[batch])})
            save_partial(args, "peers", rows, device)
    if llama_server is not None:
        _add_llamacpp_rows(args, llama_server, path, prompts, device, rows)
    # transformers compiles a static-cache generate by itself only on accelerators
    compile_ = args.compile and device.type == "cuda"
    peers = [("hf_eager", False, False), ("hf_static_compile" if compile_ else "hf_static", True, compile_)]
    peers = [p for p, name in zip(peers, ("eager", "static")) if name in wanted]
    for name, static, compile_ in peers:
        for batch in args.batches:
            if gguf_file is not None:  # transformers reads GGUF only by dequantizing it: not the same weights
                rows.append({"engine": name, "batch": batch, "tok_s": None, "wall_s": None,
                             "error": "not run: transformers would dequantize the GGUF file"})
                continue
            result = hf_generate_tok_s(path, device, getattr(torch, args.peer_dtype), prompts[batch],
                                       args.new_tokens, static, compile_, args.repeats)
            rows.append({"engine": name, "batch": batch, **result})
            save_partial(args, "peers", rows, device)
    emit(args, "peers", rows, _summary(rows, floor_b1_tok_s, bw_gb_s, w_bytes), device,
         ("engine", "batch", "tok_s", "wall_s", "decode_tok_s", "all_first_token_s", "steps", "error"))
    return 0


def _vocab_size(path: str) -> int:
    from engine.model import ModelConfig
    from engine.model.loader import resolve_model_path

    resolved = resolve_model_path(path)
    if resolved.is_file():
        import gguf

        embedding = next(t for t in gguf.GGUFReader(str(resolved)).tensors if t.name == "token_embd.weight")
        return int(embedding.shape[-1])
    return ModelConfig.from_file(resolved / "config.json").vocab_size


def _llama_server(args: argparse.Namespace) -> str:
    """The llama-server binary a `llamacpp` peer needs, checked before anything is measured."""
    from engine.bench.llamacpp_peer import server_path

    found = server_path(args.llama_server)
    if found is None:
        raise ConfigError("llama-server", args.llama_server or "(unset)",
                          "the llamacpp peer needs an executable llama-server: pass --llama-server PATH or set "
                          "STRATA_LLAMA_SERVER (scripts/build_llama_server.sh builds one; CUDA=1 for the GPU)")
    return found


def _add_llamacpp_rows(args: argparse.Namespace, server: str, path: str, prompts: dict[int, list[list[int]]],
                       device: torch.device, rows: list[dict[str, Any]]) -> None:
    """The checkpoint exported once as GGUF beside itself, then one llama-server per batch size."""
    from pathlib import Path

    from engine.bench.gguf_export import export_gguf
    from engine.bench.llamacpp_peer import llamacpp_generate_tok_s, server_version
    from engine.model.loader import resolve_model_path

    checkpoint = resolve_model_path(path)
    if checkpoint.is_file():  # a GGUF model: both engines read this very file
        gguf_path = checkpoint
    else:
        gguf_path = Path(args.gguf_out) if args.gguf_out else checkpoint / f"strata-peer-{args.gguf_type}.gguf"
        if not gguf_path.is_file():
            export_gguf(checkpoint, gguf_path, args.gguf_type)
    version = server_version(server)
    for batch in args.batches:
        result = llamacpp_generate_tok_s(server, gguf_path, prompts[batch], args.new_tokens,
                                         on_gpu=device.type == "cuda", repeats=args.repeats)
        rows.append({"engine": "llamacpp", "batch": batch, "version": version, **result})
        save_partial(args, "peers", rows, device)


def _summary(rows: list[dict[str, Any]], floor_b1_tok_s: float, bw_gb_s: float, w_bytes: int) -> dict[str, Any]:
    """Ratios and target checks. The floor bounds a decode step, so Strata's steady decode rate is held
    against it; the peers are compared end to end (the same measure for both sides)."""
    def row(engine: str, batch: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["engine"] == engine and r["batch"] == batch), None)

    summary: dict[str, Any] = {"copy_bandwidth_gb_s": bw_gb_s, "weight_mib": w_bytes / 2**20,
                               "floor_b1_tok_s": floor_b1_tok_s}
    strata_b1, hf_b1 = row("strata", 1), row("hf_eager", 1)
    if strata_b1 is not None and strata_b1["tok_s"]:
        decode_b1 = strata_b1.get("decode_tok_s") or strata_b1["tok_s"]
        summary["strata_b1_tok_s"] = strata_b1["tok_s"]
        summary["strata_b1_decode_tok_s"] = decode_b1
        summary["strata_b1_fraction_of_floor"] = decode_b1 / floor_b1_tok_s
        summary["meets_b1_target"] = decode_b1 >= TARGET_B1_TOK_S
        summary["meets_floor_target"] = decode_b1 / floor_b1_tok_s >= TARGET_FRACTION_OF_FLOOR
        if hf_b1 is not None and hf_b1["tok_s"]:
            summary["meets_hf_target"] = strata_b1["tok_s"] / hf_b1["tok_s"] >= TARGET_VS_HF_EAGER
    for r in rows:
        strata = row("strata", r["batch"])
        if r["engine"] not in ("strata", "floor") and r["tok_s"] and strata is not None and strata["tok_s"]:
            summary[f"strata_vs_{r['engine']}_b{r['batch']}"] = strata["tok_s"] / r["tok_s"]
    return summary

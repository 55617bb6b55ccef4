"""int8 KV's quality cost against unquantized KV, measured through the serving KV cache (chunked prefill, so
every attention read after the first chunk goes through stored, quantized KV).

Run as a script for the figure recorded in docs/KV.md:
    .venv/bin/python -m tests.engine.exec.test_kv_int8_quality [CHECKPOINT] [--tokens N] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.exec.kv.cache import SlotKVCache
from engine.exec.kv.geometry import KVGeometry
from tests.engine.engine_helpers import one_thread, shared_lively_checkpoint


@dataclass
class Int8Cost:
    tokens: int
    max_logit_err: float
    mean_logit_err: float
    logit_std: float
    mean_kl: float
    top1_agreement: float
    loss_unquantized: float
    loss_int8: float


def _logits(lm, storage: str, ids: list[int], chunk_tokens: int) -> torch.Tensor:
    cfg = lm.config
    geo = KVGeometry(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, len(ids), chunk_tokens)
    kv = SlotKVCache(geo, storage, lm.dtype, lm.device)
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk_tokens):
            piece = ids[start:start + chunk_tokens]
            kv.bind(torch.tensor([0], device=lm.device), start + len(piece))
            pos = torch.arange(start, start + len(piece), device=lm.device).view(1, -1)
            hidden = lm.model(torch.tensor([piece], device=lm.device), pos, kv)
            out.append(lm.model.logits(hidden)[0].float())
    return torch.cat(out)  # [N, V]


def measure_int8_cost(model: str | Path, ids: list[int], chunk_tokens: int = 64, dtype: str = "float32",
                      device: str = "cpu") -> Int8Cost:
    """Logits of the same tokens with unquantized and int8 KV: logit error, KL, top-1 agreement, loss."""
    from engine.model import load_checkpoint

    lm = load_checkpoint(model, dtype=dtype, device=device, tokenizer=False)
    ref = _logits(lm, "bf16", ids, chunk_tokens)
    q = _logits(lm, "int8", ids, chunk_tokens)
    err = (ref - q).abs()
    logp_ref, logp_q = ref.log_softmax(-1), q.log_softmax(-1)
    kl = (logp_ref.exp() * (logp_ref - logp_q)).sum(-1)
    targets = torch.tensor(ids[1:], device=ref.device)
    loss_ref = float(torch.nn.functional.cross_entropy(ref[:-1], targets))
    loss_q = float(torch.nn.functional.cross_entropy(q[:-1], targets))
    return Int8Cost(len(ids), float(err.max()), float(err.mean()), float(ref.std()), float(kl.mean()),
                    float((ref.argmax(-1) == q.argmax(-1)).float().mean()), loss_ref, loss_q)


def test_int8_kv_costs_little_against_unquantized_kv(tmp_path_factory):
    ckpt = shared_lively_checkpoint(tmp_path_factory)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (384,), generator=gen).tolist()
    with one_thread():
        cost = measure_int8_cost(ckpt, ids)
    assert cost.max_logit_err > 0  # the int8 path really quantized something
    assert cost.mean_logit_err < 0.02 * cost.logit_std
    assert cost.top1_agreement >= 0.97
    assert math.isfinite(cost.mean_kl) and cost.mean_kl < 1e-3


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", help="checkpoint dir or builtin:strata-tiny (default: a lively random one)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--text", help="a UTF-8 text file to score (default: random token ids)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = args.checkpoint
    if path is None:
        import tempfile

        from tests.engine.engine_helpers import lively_checkpoint

        path = lively_checkpoint(Path(tempfile.mkdtemp()) / "lively")
    if args.text:
        from engine.model import load_checkpoint

        ids = load_checkpoint(path, device="cpu").tokenizer.encode(Path(args.text).read_text())[: args.tokens]
    else:
        ids = torch.randint(3, 500, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    cost = measure_int8_cost(path, ids, args.chunk, args.dtype, args.device)
    for name, value in cost.__dict__.items():
        print(f"{name:18s} {value:.6g}" if isinstance(value, float) else f"{name:18s} {value}")


if __name__ == "__main__":
    _main()

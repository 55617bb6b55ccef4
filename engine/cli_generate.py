"""`strata-engine generate`: load a checkpoint, generate for one prompt, print the text and the speed.

For now this runs the model directly with a DenseKVCache and a small sampler; `generate_ids` is the one
function to swap for the serving engine later.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from engine.cli_options import add_engine_options, config_from_args
from engine.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The shared model options plus --prompt, --max-tokens, --temperature, --top-p, --seed."""
    add_engine_options(parser)
    g = parser.add_argument_group("generation")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")


def _validate(args: argparse.Namespace) -> None:
    if args.max_tokens <= 0:
        raise ConfigError("max_tokens", args.max_tokens, "expected a positive whole number")
    if args.temperature < 0:
        raise ConfigError("temperature", args.temperature, "expected >= 0 (0 is greedy)")
    if not 0 < args.top_p <= 1:
        raise ConfigError("top_p", args.top_p, "expected 0 < top_p <= 1")


@dataclass
class Generation:
    """The generated ids and how long prefill and decode took."""

    token_ids: list[int]
    finish_reason: str  # "stop" (an eos id) or "length"
    prefill_s: float
    decode_s: float


def sample_next(logits, temperature: float, top_p: float, generator):
    """One token id from logits [V]: argmax at temperature 0, else temperature + top-p sampling."""
    import torch

    if temperature == 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def generate_ids(lm, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float, seed: int | None) -> Generation:
    """Prefill the prompt into a DenseKVCache, then decode one token at a time until eos or max_tokens."""
    import torch

    from engine.model import DenseKVCache

    model, device = lm.model, lm.device
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    kv = DenseKVCache.for_config(lm.config, 1, len(prompt_ids) + max_tokens, lm.dtype, device)
    eos = set(lm.eos_token_ids)
    out: list[int] = []
    with torch.inference_mode():
        start = time.perf_counter()
        ids = torch.tensor([prompt_ids], device=device)
        positions = torch.arange(len(prompt_ids), device=device)[None]
        logits = model.logits(model(ids, positions, kv)[:, -1])[0]
        token = sample_next(logits, temperature, top_p, generator)  # the .item() syncs, so the timing is honest
        prefill_s = time.perf_counter() - start
        out.append(token)
        start = time.perf_counter()
        while token not in eos and len(out) < max_tokens:
            pos = len(prompt_ids) + len(out) - 1
            step = torch.tensor([[token]], device=device)
            logits = model.logits(model(step, torch.tensor([[pos]], device=device), kv)[:, -1])[0]
            token = sample_next(logits, temperature, top_p, generator)
            out.append(token)
        decode_s = time.perf_counter() - start
    return Generation(out, "stop" if out[-1] in eos else "length", prefill_s, decode_s)


def run(args: argparse.Namespace) -> int:
    """Load, generate, print the text and one stats line. StrataErrors propagate to engine.cli (exit 2)."""
    _validate(args)
    config = config_from_args(args)
    from engine.model import load_checkpoint

    lm = load_checkpoint(config.model, dtype=config.dtype, device=config.device)
    prompt_ids = lm.tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise ConfigError("prompt", args.prompt, "encodes to no tokens")
    result = generate_ids(lm, prompt_ids, args.max_tokens, args.temperature, args.top_p, args.seed)
    shown = result.token_ids[:-1] if result.finish_reason == "stop" else result.token_ids
    print(lm.tokenizer.decode(shown))
    n = len(result.token_ids)
    # the first token comes from prefill; decode speed counts the ones after it
    decode_tps = (n - 1) / result.decode_s if n > 1 and result.decode_s > 0 else 0.0
    print(
        f"[{n} tokens ({result.finish_reason}), prompt {len(prompt_ids)} tokens in {result.prefill_s:.3f} s, "
        f"decode {decode_tps:.1f} tokens/s on {lm.device} {str(lm.dtype).removeprefix('torch.')}]"
    )
    sys.stdout.flush()
    return 0

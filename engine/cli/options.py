"""The model and engine options shared by serve, generate and bench, mapped onto EngineConfig."""

from __future__ import annotations

import argparse
import os

from engine.config import API_KEY_ENV, BUILTIN_MODEL, KV_DTYPES, MODEL_DTYPES, EngineConfig
from engine.errors import ConfigError
from engine.switches import switches_from_env


def add_engine_options(parser: argparse.ArgumentParser, serving: bool = False) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("model and engine")
    g.add_argument("--model", default=BUILTIN_MODEL, help=f"checkpoint directory or {BUILTIN_MODEL} (default)")
    g.add_argument("--device", default=d.device, help="auto | cpu | cuda:N (default auto)")
    g.add_argument("--dtype", default=d.dtype, choices=MODEL_DTYPES, help="weights dtype (auto: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--batch", type=int, default=d.batch, help=f"concurrent request slots (default {d.batch})")
    g.add_argument("--batch-mtp", action="store_true", help="batched MTP speculative drafting for all decoding slots")
    g.add_argument("--mtp-depth", type=int, default=d.mtp_depth, help="draft tokens per MTP round (default 1)")
    g.add_argument("--kv", default=d.kv, choices=KV_DTYPES, help="KV cache dtype (default bf16)")
    g.add_argument("--kv-resident", type=int, default=None, metavar="TOKENS", help="tokens of each slot's KV kept on the GPU")
    g.add_argument("--context", type=int, default=d.context, metavar="TOKENS", help=f"context per slot (default {d.context})")
    g.add_argument("--vram-reserve-mib", type=int, default=d.vram_reserve_mib, metavar="MIB", help="VRAM the engine never takes")
    g.add_argument("--peer-device", default=None, metavar="cuda:N", help="second GPU for the prefix-cache tier")
    g.add_argument("--queue-max", type=int, default=d.queue_max, help="bounded request queue length")
    g.add_argument("--prefill-chunk-tokens", type=int, default=d.prefill_chunk_tokens, help="prompt tokens per prefill chunk")
    g.add_argument("--step-token-budget", type=int, default=d.step_token_budget, help="tokens one engine step may process")
    g.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=d.graphs, help="CUDA graphs on GPU (default on)")
    g.add_argument("--tier-wait-polls", type=int, default=d.tier_wait_polls, help="polls for tier room after a graph OOM")
    g.add_argument("--tier-wait-interval-s", type=float, default=d.tier_wait_interval_s, help="seconds between those polls")
    if serving:
        s = parser.add_argument_group("server")
        s.add_argument("--host", default=d.host, help="address to bind (default 127.0.0.1)")
        s.add_argument("--port", type=int, default=d.port, help="port (0 picks a free one)")
        s.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help=f"require Authorization: Bearer KEY on every route but /health (or set {API_KEY_ENV}: "
                            f"unlike argv, the environment is not shown in the process list)")
        s.add_argument("--max-body-mib", type=int, default=d.max_body_mib, metavar="MIB",
                       help=f"request bodies above this get 413 before they are parsed (default {d.max_body_mib})")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed options plus `STRATA_*` switches read from the environment."""
    try:
        switches = switches_from_env(os.environ)
    except ConfigError:
        raise
    values = {k: v for k, v in vars(args).items() if k in EngineConfig.__dataclass_fields__}
    return EngineConfig(**values, switches=switches)

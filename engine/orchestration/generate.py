"""One prompt through the serving engine, start to finish: the core of `strata-engine generate`."""

from __future__ import annotations

import time
from typing import Any

from engine.api import SamplingParams
from engine.config import EngineConfig
from engine.orchestration.engine import Engine
from engine.errors import CheckpointError, EngineDead
from engine.telemetry import EventBus


def generate_text(config: EngineConfig, prompt: str, params: SamplingParams,
                  bus: EventBus | None = None) -> tuple[str, dict[str, Any]]:
    """Load an engine, generate for one prompt, and return (text, stats): the `generate` subcommand's core.

    stats: prompt/completion/cached tokens, finish reason, prefill and decode tok/s, MTP acceptance, seconds.
    """
    engine = Engine(config, bus if bus is not None else EventBus())
    if engine.tokenizer is None:
        raise CheckpointError(config.model, "no tokenizer.json: cannot encode a text prompt")
    start_s = time.monotonic()
    req = engine.add_request("generate-0", engine.tokenizer.encode(prompt), params)
    pieces: list[str] = []
    last = None
    while engine.has_work:
        for out in engine.step():
            pieces.append(out.text)
            last = out
    if last is not None and last.error:
        raise EngineDead(last.error)
    stats = {
        "prompt_tokens": req.num_prompt_tokens, "completion_tokens": req.num_output_tokens,
        "cached_tokens": req.num_cached_tokens, "finish_reason": req.finish_reason,
        "prefill_tok_s": req.prefill_tok_s(), "decode_tok_s": req.decode_tok_s(),
        "acceptance_per_position": [req.acceptance_at(i) for i in range(len(req.draft_proposed))],
        "acceptance": req.acceptance, "mtp": engine.mtp_on, "elapsed_s": time.monotonic() - start_s,
        "device": str(engine.device),
    }
    return "".join(pieces), stats

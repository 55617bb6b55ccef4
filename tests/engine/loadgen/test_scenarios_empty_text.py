"""The seed scenario against a real server whose generated tokens decode to empty text.

The random benchmark checkpoints (`--random-model 0.6b`, `moe-bench`) have a model vocabulary far larger than
their tokenizer's, so most generated ids have no text. A load client that counts text then sees no token until the
final usage chunk, and the seed reports PASS with no long-prompt TTFT and no decode rates. It must count tokens,
not text. Here: the tiny shape with the 0.6b vocabulary, in-process (AsyncEngine on CPU behind a live uvicorn).
"""

from __future__ import annotations

import pytest

from engine.loadgen.scenarios import run_scenario
from tests.engine.server.real import real_server

pytestmark = pytest.mark.timeout(180)
WIDE_VOCAB = 151_936  # the Qwen3-0.6B vocabulary over the toy tokenizer's 512 ids


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory):
    from engine.model.random_checkpoint import write_random_checkpoint

    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("wide-vocab"), vocab_size=WIDE_VOCAB)
    with real_server(str(checkpoint), batch=4, context=2048) as (url, _, _):
        yield url


async def test_seed_measures_ttft_and_decode_rates_when_tokens_have_no_text(server_url: str) -> None:
    # 1.5 s before the long prompt: the rate "before" needs the shorts' first tokens before it is sent, and on a
    # busy two-core machine 0.5 s once left that window empty (short_decode_tok_s_before None)
    result = await run_scenario("seed", server_url, concurrency=2, short_prompt_tokens=8, delay_s=1.5,
                                long_tokens=600, long_max_tokens=2, ignore_eos=1)
    assert result.ok, result.errors
    long = result.requests[-1]
    assert long.label == "long" and long.completion_tokens == 2
    metrics = result.metrics
    assert metrics["long_ttft_s"] is not None and metrics["long_ttft_s"] > 0, metrics
    assert metrics["short_decode_tok_s_before"] is not None and metrics["short_decode_tok_s_before"] > 0, metrics
    # every token of every request was seen as it came, not only in the final usage count
    for r in result.requests:
        assert r.first_token_s is not None and round(sum(n for _, n in r.increments)) == r.completion_tokens, \
            r.summary()

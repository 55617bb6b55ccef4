"""The vLLM, SGLang and llama.cpp adapters read a local server replaying each engine's routes and metrics
(tests/tui/fixtures/engines/, version in the file name), and detection names each kind from the routes that
answer."""

from __future__ import annotations

import httpx
import pytest

from strata_tui.adapters import adapter_for, detect
from strata_tui.adapters.prometheus import Metrics
from tests.tui.engine_replay import replay_server, routes_for


async def read(kind: str, routes=None):
    with replay_server(routes or routes_for(kind)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            return await adapter_for(kind, server.url).read(client)


async def test_vllm_maps_its_metrics_onto_the_panels() -> None:
    view = await read("vllm")
    assert view.reachable and view.version == "0.10.1.1" and view.model == "Qwen/Qwen3-8B"
    assert view.running == 21 and view.waiting == 3  # two data-parallel engines, summed
    assert view.kv_usage == pytest.approx((0.62 + 0.48) / 2)
    assert view.prefix_hit == pytest.approx((702000 + 511000) / (1204000 + 998000))
    assert view.preemptions == 5
    assert view.spec_per_position == pytest.approx([0.82, 0.63, 0.40])
    assert view.spec_mean_length == pytest.approx(1 + 37000 / 20000)
    assert 0.1 < view.ttft_p50_s < 0.5 < view.ttft_p95_s
    assert 0.025 < view.itl_p50_s < 0.05
    assert view.slots is None and view.cannot["prefill"] == "vLLM exposes no per-request prefill progress"


async def test_sglang_maps_its_metrics_and_says_what_it_cannot_feed() -> None:
    view = await read("sglang")
    assert view.version == "0.5.3" and view.running == 17 and view.waiting == 5
    assert view.kv_usage == pytest.approx(0.57) and view.kv_label == "tokens"
    assert view.prefix_hit == pytest.approx(0.41) and view.preemptions == 6
    assert view.spec_per_position is None and view.spec_mean_length == pytest.approx(2.61)
    assert "not per draft position" in view.cannot["spec"]
    assert 0.1 < view.ttft_p50_s < 0.2 and 0.006 < view.itl_p50_s < 0.01
    assert view.cannot["prefill"] == "SGLang exposes no per-request prefill progress"


async def test_sglang_without_enable_metrics_says_so_instead_of_zeros() -> None:
    routes = routes_for("sglang")
    del routes["/metrics"]
    view = await read("sglang", routes)
    assert view.running is None and view.kv_usage is None and view.ttft_p50_s is None
    assert "--enable-metrics" in view.cannot["requests"]


async def test_llamacpp_slots_give_prefill_progress_as_tokens_processed() -> None:
    view = await read("llamacpp")
    slots = {s.id: s for s in view.slots}
    assert [s.state for s in view.slots] == ["prefill", "decode", "decode", "idle", "idle", "decode"]
    assert slots[0].prompt_done_tokens == 14336 + 2048  # the cached prefix counts as done
    assert slots[0].prompt_tokens is None and slots[0].prefill_fraction is None  # /slots has no prompt length
    assert "not the prompt's length" in view.cannot["prefill"]
    assert slots[1].decoded_tokens == 233 and slots[1].held_tokens == 1433 and slots[0].context_tokens == 43690
    assert view.kv_usage == pytest.approx((16384 + 1433 + 961 + 3512 + 2212) / (6 * 43690))
    assert view.running == 4 and view.waiting == 2
    assert view.prefix_hit == pytest.approx(20480 / (61234 + 20480))
    assert view.ttft_p50_s is None and "no latency histograms" in view.cannot["latency"]
    assert view.model == "qwen3-8b-q4_k_m.gguf"


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llamacpp"])
async def test_detect_names_each_kind(kind: str) -> None:
    with replay_server(routes_for(kind)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            assert await detect(client) == kind


async def test_detect_strata_and_nothing() -> None:
    with replay_server({"/strata/state": (200, "application/json", "{}")}) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            assert await detect(client) == "strata"
    with replay_server({"/version": (200, "application/json", '{"version": "1"}'),
                        "/metrics": (200, "text/plain", "up 1\n")}) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            assert await detect(client) is None  # a /version alone is not vLLM


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    metrics = Metrics('h_bucket{le="1.0"} 10\nh_bucket{le="2.0"} 30\nh_bucket{le="+Inf"} 30\nh_count 30\nh_sum 40\n')
    hist = metrics.histogram("h")
    assert hist.quantile(0.5) == pytest.approx(1.25)  # rank 15: 5 of the 20 in (1, 2]
    assert hist.mean() == pytest.approx(40 / 30)
    assert Metrics("").histogram("h") is None


async def test_nan_negative_huge_and_repeated_values_are_invalid_not_a_failure_or_a_number() -> None:
    """The endpoint answers: it is read (not "unreachable"), and each value out of its range is left out
    with what it was, never summed, printed or turned into an error."""
    from tests.tui.hostile_server import BAD_VALUES, DUPLICATE_LINE

    text = "text/plain; version=0.0.4"
    routes = {"/version": (200, "application/json", '{"version": "0.10.1.1"}'),
              "/metrics": (200, text, BAD_VALUES + DUPLICATE_LINE.decode() * 3)}
    view = await read("vllm", routes)
    assert view.reachable
    assert view.waiting is None and "-7" in view.invalid["vllm:num_requests_waiting"]
    assert view.kv_usage is None and "1e+300" in view.invalid["kv_usage"]
    assert view.ttft_p50_s is None and "NaN" in view.invalid["vllm:time_to_first_token_seconds_count"]
    assert view.running is None and "repeats a series 3 times" in view.invalid["vllm:num_requests_running"]


async def _two_reads(kind: str, counters: dict[str, tuple[float, float]], pause_s: float = 0.3):
    """Read an endpoint twice while its token counters grow between the reads (name -> (first, second))."""
    routes = routes_for(kind)
    metrics = routes["/metrics"][2]
    with replay_server(routes) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            adapter = adapter_for(kind, server.url)
            views = []
            for step in (0, 1):
                text = metrics
                for name, values in counters.items():
                    text = "\n".join(f"{line.split(' ')[0]} {values[step]}" if line.split("{")[0].split(" ")[0] == name
                                     else line for line in text.splitlines())
                routes["/metrics"] = (200, routes["/metrics"][1], text)
                views.append(await adapter.read(client))
                if step == 0:
                    await __import__("asyncio").sleep(pause_s)
    return views


async def test_llamacpp_decode_rate_comes_from_its_token_counter_while_its_gauge_reads_zero() -> None:
    """A busy llama-server's rate gauge reads 0 while its slots decode (it averages finished requests only); the
    counter of predicted tokens grew by 600 in the pause: the rate shown is that growth over the time between."""
    counters = {"llamacpp:tokens_predicted_total": (2096, 2696), "llamacpp:prompt_tokens_total": (61234, 61234),
                "llamacpp:predicted_tokens_seconds": (0, 0)}
    first, second = await _two_reads("llamacpp", counters)
    assert first.decode_tokens_s is None  # nothing to compare with yet: no figure rather than the gauge's 0
    # the time between the reads is at least the pause (more on a loaded machine): the rate at most 600 / pause
    assert second.decode_tokens_s is not None and 0 < second.decode_tokens_s < 600 / 0.3 * 1.01
    assert second.prompt_tokens_s == 0


@pytest.mark.parametrize("kind,counter", [("vllm", "vllm:generation_tokens_total"),
                                          ("sglang", "sglang:generation_tokens_total")])
async def test_vllm_and_sglang_decode_rates_come_from_their_token_counters(kind: str, counter: str) -> None:
    samples = sum(1 for line in routes_for(kind)["/metrics"][2].splitlines() if line.startswith(counter))
    first, second = await _two_reads(kind, {counter: (1000, 1900)})
    assert first.decode_tokens_s is None  # vLLM has no gauge; SGLang's counter wins over it
    assert second.decode_tokens_s is not None and 0 < second.decode_tokens_s < 900 * samples / 0.3 * 1.01

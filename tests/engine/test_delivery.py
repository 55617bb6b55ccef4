"""OutputRouter: a step's outputs reach each waiting client's asyncio queue in order, whatever loop it awaits on;
a finished request and a closed loop's requests are forgotten, and the other loops still get theirs."""

from __future__ import annotations

import asyncio
import threading

from engine.api import RequestOutput
from engine.orchestration.delivery import OutputRouter


def _loop_thread() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def _drain(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, n: int) -> list[RequestOutput]:
    async def take() -> list[RequestOutput]:
        return [await asyncio.wait_for(queue.get(), timeout=30) for _ in range(n)]

    return asyncio.run_coroutine_threadsafe(take(), loop).result(timeout=60)


def test_outputs_reach_their_queues_in_order_and_a_closed_loop_costs_only_its_own_requests() -> None:
    (a, ta), (b, tb) = _loop_thread(), _loop_thread()
    router = OutputRouter()
    queues = {}
    for rid, loop in (("a0", a), ("a1", a), ("b0", b)):
        queues[rid] = asyncio.run_coroutine_threadsafe(asyncio.sleep(0, asyncio.Queue()), loop).result()
        router.register(rid, loop, queues[rid])
    router.deliver([RequestOutput("a0", [1], "x"), RequestOutput("b0", [2], "y"), RequestOutput("a1", [3], "z"),
                    RequestOutput("a0", [4], "w", finished=True, finish_reason="length"),
                    RequestOutput("nobody", [5], "v")])
    assert [o.token_ids for o in _drain(a, queues["a0"], 2)] == [[1], [4]]
    assert [o.text for o in _drain(a, queues["a1"], 1)] == ["z"]
    assert [o.text for o in _drain(b, queues["b0"], 1)] == ["y"]
    assert sorted(router.request_ids()) == ["a1", "b0"]  # a finished request is forgotten

    b.call_soon_threadsafe(b.stop)
    tb.join(timeout=30)
    b.close()
    router.deliver([RequestOutput("b0", [6], "u"), RequestOutput("a1", [7], "t")])
    assert [o.text for o in _drain(a, queues["a1"], 1)] == ["t"]
    assert router.request_ids() == ["a1"]  # b0's loop is closed: nobody waits for it any more
    a.call_soon_threadsafe(a.stop)
    ta.join(timeout=30)
    a.close()

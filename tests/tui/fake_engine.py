"""A stand-in for `strata-engine serve` for the TUI's pilot tests: a real process with a real HTTP server.

It speaks the map's protocol (ready line, /health, /strata/state, /strata/events SSE with id = seq and
Last-Event-ID resume, the control routes, /v1/models and a streaming /v1/completions) using the engine's own
torch-free modules (telemetry bus, switch board), so the app is tested against the wire format, not a mock
object. It loads no model. Behaviour comes from the environment:

  FAKE_ENGINE_EVENTS  a .jsonl of recorded events to preload into the history ring
  FAKE_ENGINE_MODE    serve (default) | crash (exit 1 with a real-looking error after ready)
                      | fail-start (exit 2 at once) | ignore-term (ignore SIGTERM: tests the SIGKILL path)
                      | slow-term (on SIGTERM: log for 3 s, as an engine finishing a long chunk does, then exit 0)
                      | warn-term (on SIGTERM: a WARNING record on stderr, as uvicorn's while requests run, then exit 0)
  FAKE_ENGINE_BUSY    "SLOTS:HZ": keep SLOTS slots decoding, each publishing HZ slot events a second,
                      plus a VRAM event a second (the TUI benchmark's steady load)
  FAKE_ENGINE_EXPERTS a recorded /strata/state (fixtures/moe_state.json): an MoE engine whose state has that
                      `experts` section and whose POST /strata/expert-cache resizes it (whole slots per layer,
                      as engine.exec.experts.cache does); without it, the route answers 409 like a dense model
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.errors import SwitchNeedsRestart, UnknownSwitch  # noqa: E402
from engine.switches import SwitchBoard, switches_from_env  # noqa: E402
from engine.telemetry import (EventBus, ExpertEvent, SlotEvent, SwitchEvent, VramEvent,  # noqa: E402
                              event_from_json)

_EXPERTS_FILE = os.environ.get("FAKE_ENGINE_EXPERTS")
EXPERTS: dict | None = json.loads(Path(_EXPERTS_FILE).read_text())["experts"] if _EXPERTS_FILE else None

BUS = EventBus(history=4096)
BOARD = SwitchBoard.from_values(switches_from_env(os.environ))
for _name in filter(None, os.environ.get("FAKE_ENGINE_UNAVAILABLE", "").split(",")):
    BOARD.mark_unavailable(_name, "needs a CUDA device with Triton (this engine runs on cpu)")  # as on CPU
RESERVE = {"mib": 1024}
REQUESTS = itertools.count()  # next() is atomic under the GIL: the handler threads share it
CONTEXT_TOKENS = 8192


def log(line: str) -> None:
    print(line, flush=True)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep stderr for the errors the tests look for
        pass

    def _json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            self._json(200, {"ready": True, "reason": "ready"})
        elif self.path == "/strata/state":
            self._json(200, {"config": {"vram_reserve_mib": RESERVE["mib"], "context": CONTEXT_TOKENS},
                             "switches": BOARD.snapshot(), "slots": [], "vocab_size": 1000, "experts": EXPERTS,
                             "instance_id": BUS.epoch})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model", "vocab_size": 1000,
                                                          "context_tokens": CONTEXT_TOKENS}]})
        elif self.path == "/strata/events":
            self._events()
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def _events(self) -> None:
        after = int(self.headers.get("Last-Event-ID") or 0)
        log(f"GET /strata/events Last-Event-ID={after}")
        sub = BUS.subscribe(after_seq=after)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            while True:
                events = sub.get(timeout_s=1.0)
                chunk = "".join(f"id: {e.seq}\nevent: {e.type}\ndata: {json.dumps(e.to_json())}\n\n" for e in events)
                self.wfile.write((chunk or ": keep-alive\n\n").encode())
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            sub.close()

    def do_POST(self) -> None:  # noqa: N802
        body = self._body()
        if self.path.startswith("/strata/switches/"):
            name = self.path.rsplit("/", 1)[1]
            log(f"POST /strata/switches/{name} enabled={body.get('enabled')}")
            try:
                state = BOARD.set_live(name, bool(body.get("enabled")))
            except SwitchNeedsRestart as exc:
                self._json(409, {"error": {"message": str(exc), "type": "switch_needs_restart"}})
                return
            except UnknownSwitch as exc:
                self._json(404, {"error": {"message": str(exc)}})
                return
            # as engine/orchestration/async_engine.py publishes it and engine/server/app.py answers
            BUS.publish(SwitchEvent(name=state.name, state="unavailable" if state.unavailable else
                                    "on" if state.enabled else "off", reason=state.reason))
            self._json(200, {"switch": state.to_json()})
        elif self.path == "/strata/vram-reserve":
            RESERVE["mib"] = int(body.get("mib", RESERVE["mib"]))
            log(f"POST /strata/vram-reserve mib={RESERVE['mib']}")
            BUS.publish(VramEvent(device="cpu", total_mib=24576, weights_mib=12, reserve_mib=RESERVE["mib"],
                                  free_mib=20000))
            self._json(200, {"vram_reserve_mib": RESERVE["mib"]})  # engine/server/app.py's answer
        elif self.path == "/strata/expert-cache":
            self._expert_cache(body)
        elif self.path == "/v1/completions":
            self._complete(body)
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def _expert_cache(self, body: dict) -> None:
        mib = body.get("mib")
        log(f"POST /strata/expert-cache mib={mib}")
        if EXPERTS is None:
            self._json(409, {"error": {"message": "the model fake has no MoE layers: there is no expert cache to "
                                                  "resize", "code": "no_expert_cache", "param": "mib"}})
            return
        slot_mib = EXPERTS["num_layers"] * EXPERTS["expert_mib"]
        slots = max(1, min(EXPERTS["num_experts"], int(mib // slot_mib) - 1))
        before = EXPERTS["mib"]
        EXPERTS.update(slots=slots, target_slots=slots, mib=slot_mib * (slots + 1))
        BUS.publish(ExpertEvent(action="grow" if EXPERTS["mib"] >= before else "shrink",
                                mib=abs(EXPERTS["mib"] - before), total_mib=EXPERTS["mib"], slots=slots,
                                reason=f"expert cache set to {mib} MiB", device="cpu"))
        BUS.publish(VramEvent(device="cpu", total_mib=24576, weights_mib=12, reserve_mib=RESERVE["mib"],
                              experts_mib=EXPERTS["mib"], free_mib=20000))
        self._json(200, {"expert_cache_mib": mib, "experts": EXPERTS})

    def _complete(self, body: dict) -> None:
        prompt = body.get("prompt") or []
        prompt_tokens = len(prompt) if isinstance(prompt, list) else 8
        max_tokens = int(body.get("max_tokens", 8))
        slot = next(REQUESTS) % 4  # requests take turns over 4 slots (a thread's id is aligned: always 0 mod 4)
        log(f"POST /v1/completions prompt_tokens={prompt_tokens} max_tokens={max_tokens} slot={slot}")
        rid = f"cmpl-{BUS.last_seq}"
        BUS.publish(SlotEvent(slot=slot, state="prefill", request_id=rid, prompt_tokens=prompt_tokens,
                              max_tokens=max_tokens, eta_s=0.1))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            self.wfile.flush()

        try:  # a client that closes the stream aborts its request, as the engine does
            for i in range(max_tokens):
                time.sleep(0.005)
                BUS.publish(SlotEvent(slot=slot, state="decode", request_id=rid, prompt_tokens=prompt_tokens,
                                      prefilled_tokens=prompt_tokens, generated_tokens=i + 1, max_tokens=max_tokens,
                                      decode_tok_s=200.0))
                finish = "length" if i == max_tokens - 1 else None
                send(json.dumps({"id": rid, "choices": [{"index": 0, "text": "x", "finish_reason": finish}]}))
            send(json.dumps({"id": rid, "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                                 "completion_tokens": max_tokens}}))
            send("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            BUS.publish(SlotEvent(slot=slot, state="idle"))


def busy(slots: int, hz: float) -> None:
    """Publish decode progress for `slots` slots at `hz` updates per slot per second, forever."""
    generated = [0] * slots
    period_s = 1.0 / hz
    next_vram_s = time.monotonic()
    while True:
        started = time.monotonic()
        for slot in range(slots):
            generated[slot] += 1
            BUS.publish(SlotEvent(slot=slot, state="decode", request_id=f"busy-{slot}", prompt_tokens=512,
                                  prefilled_tokens=512, generated_tokens=generated[slot], max_tokens=1 << 20,
                                  decode_tok_s=hz + slot * 0.1, acceptance=0.7))
        if started >= next_vram_s:
            BUS.publish(VramEvent(device="cuda:0", total_mib=143771, weights_mib=16384, kv_mib=9000.0 + generated[0],
                                  graphs_mib=247, tier_mib=100000, reserve_mib=RESERVE["mib"], free_mib=17000))
            next_vram_s = started + 1.0
        time.sleep(max(0.0, period_s - (time.monotonic() - started)))


def slow_stop() -> None:
    """Stop as an engine busy with a long chunk does: it keeps writing log lines, then exits cleanly."""
    for i in range(30):
        log(f"stopping: finishing the chunk ({i})")
        time.sleep(0.1)
    log("stopped")
    os._exit(0)


def warn_stop() -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')},123 WARNING strata.serve: stopping with 2 requests running: "
          "they are aborted", file=sys.stderr, flush=True)
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--vram-reserve-mib", type=int, default=1024)
    args, _unknown = parser.parse_known_args()
    RESERVE["mib"] = args.vram_reserve_mib
    mode = os.environ.get("FAKE_ENGINE_MODE", "serve")
    if mode == "fail-start":
        print("strata-engine serve: error: model='/nope': not a checkpoint directory", file=sys.stderr, flush=True)
        return 2
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "slow-term":
        signal.signal(signal.SIGTERM, lambda *_: slow_stop())
    if mode == "warn-term":
        signal.signal(signal.SIGTERM, lambda *_: warn_stop())
    switches_on = ",".join(n for n, s in BOARD.states.items() if s.enabled) or "none"
    log(f"\x1b[32mfake engine\x1b[0m argv={' '.join(sys.argv[1:])} switches={switches_on}")
    sys.stdout.write("loading 10%\rloading 60%\rloading 100%\n")
    events_file = os.environ.get("FAKE_ENGINE_EVENTS")
    if events_file:
        for line in Path(events_file).read_text().splitlines():
            if line.strip():
                event = event_from_json(json.loads(line))
                if event.type not in ("error",) and not (event.type == "engine" and event.state == "exit"):
                    BUS.publish(event)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log(f"strata-engine: ready at http://{args.host}:{server.server_address[1]}")
    busy_spec = os.environ.get("FAKE_ENGINE_BUSY")
    if busy_spec:
        slots, hz = busy_spec.split(":")
        threading.Thread(target=busy, args=(int(slots), float(hz)), daemon=True).start()
    if mode == "crash":
        time.sleep(0.5)
        print("mtp: round capture: CUDA error: an illegal memory access was encountered", file=sys.stderr,
              flush=True)
        return 1
    signal.signal(signal.SIGTERM, signal.SIG_DFL) if mode not in ("ignore-term", "slow-term", "warn-term") else None
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())

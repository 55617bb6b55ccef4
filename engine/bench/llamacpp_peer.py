"""llama.cpp's `llama-server` as a peer of `bench peers`: the same weights (exported by engine.bench.gguf_export),
the same token-id prompts, timed as Strata's rows are.

One server per batch size, with that many parallel sequences (`-np B`) and every layer on the GPU (`-ngl 999`) when
the run is on CUDA. A call sends the B prompts at once to `/completion` (token ids, greedy, `ignore_eos`, no prompt
cache) and waits for all of them: `tok_s` is B x new tokens / wall time, the same end-to-end figure as Strata's and
transformers'. `decode_tok_s` sums the server's own per-sequence generation rates (`timings.predicted_per_second`),
its steady decode. Warm-up calls first (llama.cpp builds its CUDA graphs on the first ones).
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_ENV = "STRATA_LLAMA_SERVER"
_READY_TIMEOUT_S = 300.0
_REQUEST_TIMEOUT_S = 600.0
_WARMUP_CALLS = 2


def server_path(given: str | None) -> str | None:
    """--llama-server, else $STRATA_LLAMA_SERVER; None when neither names an executable file."""
    path = given or os.environ.get(_ENV)
    return path if path and os.path.isfile(path) and os.access(path, os.X_OK) else None


def server_version(server: str) -> str:
    done = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=30)
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"


def llamacpp_generate_tok_s(server: str, gguf_path: Path, prompts: list[list[int]], new_tokens: int,
                            on_gpu: bool, repeats: int) -> dict[str, Any]:
    """Start llama-server for len(prompts) parallel sequences, warm it up, time `repeats` calls; the median row or
    the error (with the server's last log lines) as the row's result."""
    from engine.bench.common import median_of

    batch = len(prompts)
    context_tokens = batch * (max(len(p) for p in prompts) + new_tokens + 16)
    port = _free_port()
    argv = [server, "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port), "-np", str(batch),
            "-c", str(context_tokens), "-ngl", "999" if on_gpu else "0", "--no-webui"]
    if on_gpu:
        argv += ["-fa", "on"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            import httpx

            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=_REQUEST_TIMEOUT_S) as client:
                _wait_ready(client, proc)
                for _ in range(_WARMUP_CALLS):
                    _one_call(client, prompts, new_tokens)
                return {**median_of(repeats, lambda _run: _one_call(client, prompts, new_tokens)), "error": None}
        except Exception as exc:  # the peer's failure is its row's result, with what the server said
            log.seek(0)
            tail = " | ".join(log.read().strip().splitlines()[-3:])
            return {"tok_s": None, "wall_s": None, "error": f"{type(exc).__name__}: {exc}"[:300] + f" (log: {tail[:300]})"}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _one_call(client, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    body = {"n_predict": new_tokens, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False}

    def one(prompt: list[int]) -> dict[str, Any]:
        response = client.post("/completion", json={**body, "prompt": prompt})
        response.raise_for_status()
        return response.json()

    start_s = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        answers = list(pool.map(one, prompts))
    wall_s = time.perf_counter() - start_s
    predicted = [int(a.get("tokens_predicted", 0)) for a in answers]
    if any(n != new_tokens for n in predicted):
        raise RuntimeError(f"llama-server predicted {predicted} tokens, asked {new_tokens} each")
    decode = sum(float(a.get("timings", {}).get("predicted_per_second") or 0.0) for a in answers)
    return {"tok_s": sum(predicted) / wall_s, "wall_s": wall_s, "decode_tok_s": decode or None}


def _wait_ready(client, proc: subprocess.Popen) -> None:
    deadline_s = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} while loading")
        try:
            if client.get("/health", timeout=5.0).status_code == 200:
                return
        except Exception:  # not listening yet
            pass
        time.sleep(0.2)
    raise TimeoutError(f"llama-server not ready after {_READY_TIMEOUT_S:.0f} s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

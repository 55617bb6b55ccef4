"""What every torch benchmark shares: the model it measures, the device, timing, and the environment record.

`--model random:0.6b` (or `random:tiny`, optionally `random:0.6b+mtp`) writes a random-weight checkpoint of that
shape once per (size, dtype, MTP) into a cache directory and reuses it, so every benchmark of one GPU run, and
every peer in it, measures the same weights. `random:8b` is not written: the engine draws its weights on the
device at load, seeded (engine.model.random_source), the same weights at every start; nor is a synthetic source
(`random:moe-80b`: engine.model.synthetic), which the engine generates at load.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from engine.bench.report import environment
from engine.errors import ConfigError

RANDOM_PREFIX = "random:"
_CACHE_ENV = "STRATA_BENCH_CACHE"
_DONE_MARK = ".complete"


def device_of(name: str) -> torch.device:
    """`auto` -> cuda:0 when available, else cpu; a CUDA device that is not there is a ConfigError."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError("device", name, "expected auto, cpu or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", name, "CUDA device requested but torch sees no CUDA device")
    return dev


def sync(device: torch.device) -> None:
    """Wait for queued kernels (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sm_clock_mhz(device: torch.device) -> int | None:
    """The device's SM clock now, in MHz (NVML through torch), or None off CUDA or without NVML: a run of a few
    milliseconds a step moves with the clock the device happens to run at."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # no pynvml, or NVML refused: the figure is optional
        return None


def host_probe_us(rounds: int = 5) -> float:
    """The fastest of `rounds` timings of a fixed piece of pure Python, in µs: how fast the host runs this thread
    now. A batch-1 step of a small model is bound by its host work, so a run's rate moves with it (a core shared
    with another busy thread runs it slower), not only with the device."""
    best_s = float("inf")
    for _ in range(rounds):
        start_s = time.perf_counter()
        total = 0
        for i in range(2000):
            total += len(str(i))
        best_s = min(best_s, time.perf_counter() - start_s)
    return round(best_s * 1e6, 1)


def current_cpu() -> int | None:
    """The CPU this thread ran on last (Linux: /proc/thread-self/stat, field 39), or None elsewhere."""
    try:
        stat = Path("/proc/thread-self/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[36])


def event_counts(events: list[Any]) -> dict[str, int]:
    """`graph capture`, `graph degrade`, `tier shrink`, ... -> how many of each."""
    counts: dict[str, int] = {}
    for e in events:
        if e.type in ("graph", "tier"):
            name = f"{e.type} {e.action}"
            counts[name] = counts.get(name, 0) + 1
    return counts


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds `fn()` took, with the device drained before and after (kernels are asynchronous)."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def median_of(repeats: int, one_call: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """`repeats` timed calls: the call of median throughput (the lower middle one of an even count; its wall time
    and other figures with it), and every call's throughput in `tok_s_runs` (the peers' rows: Strata's,
    transformers', llama.cpp's)."""
    calls = [one_call(run) for run in range(repeats)]
    runs = [c["tok_s"] for c in calls]
    middle = sorted(calls, key=lambda c: c["tok_s"])[(repeats - 1) // 2]
    return {**middle, "tok_s_runs": runs}


def checkpoint_dtype(model_dtype: str, device: torch.device) -> str:
    """The dtype a random checkpoint is written in: what the engine will run it in."""
    if model_dtype != "auto":
        return model_dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def prepare_model(spec: str, device: torch.device, model_dtype: str = "auto") -> str:
    """A `--model` value the engine and the peers can both load: `random:SIZE[+mtp]` becomes a directory."""
    from engine.model.synthetic import is_synthetic

    if not spec.startswith(RANDOM_PREFIX) or is_synthetic(spec):  # a synthetic source is generated at load
        return spec
    size, _, extra = spec[len(RANDOM_PREFIX):].partition("+")
    if extra not in ("", "mtp"):
        raise ConfigError("model", spec, "expected random:SIZE or random:SIZE+mtp")
    from engine.model.random_checkpoint import SIZES, write_random_checkpoint

    if size not in SIZES:
        raise ConfigError("model", spec, f"unknown random size; known: {', '.join(SIZES)}")
    from engine.model.random_source import GENERATED_AT_LOAD

    if size in GENERATED_AT_LOAD:  # the engine draws its weights on the device at load (no checkpoint)
        return spec
    dtype = checkpoint_dtype(model_dtype, device)
    root = Path(os.environ.get(_CACHE_ENV) or Path(tempfile.gettempdir()) / "strata-bench-checkpoints")
    directory = root / f"{size}-{dtype}-{extra or 'nomtp'}"
    if not (directory / _DONE_MARK).exists():
        write_random_checkpoint(directory, "qwen3", "deepseek" if extra else None, size=size, dtype=dtype)
        (directory / _DONE_MARK).write_text("written by engine.bench.common.prepare_model\n")
    return str(directory)


def weight_bytes(path: str) -> int:
    """Bytes of the weights as stored (the safetensors files, or a GGUF file): what one decode step must read."""
    from engine.model.loader import resolve_model_path

    resolved = resolve_model_path(path)
    if resolved.is_file():
        return resolved.stat().st_size
    return sum(f.stat().st_size for f in resolved.glob("*.safetensors"))


def torch_env(device: torch.device) -> dict[str, Any]:
    """The environment record with torch, the device's name and, when installed, transformers."""
    extra: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        extra.update(device_name=props.name, device_total_mib=props.total_memory / 2**20,
                     cuda=torch.version.cuda)
    try:
        import transformers

        extra["transformers"] = transformers.__version__
    except ImportError:
        pass
    return environment(extra)


def random_prompt(n_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """Token ids below the top sixteenth of the vocabulary (where Qwen-family special tokens live)."""
    gen = torch.Generator().manual_seed(seed)
    upper = max(2, vocab_size - vocab_size // 16)
    return torch.randint(0, upper, (n_tokens,), generator=gen).tolist()


def emit(args: Any, bench: str, rows: list[dict[str, Any]], summary: dict[str, Any], device: torch.device,
         columns: tuple[str, ...] | None = None, env_extra: dict[str, Any] | None = None,
         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Print the table and summary, write the JSON to `args.json` (with `extra` top-level fields), return it."""
    from engine.bench.report import document, print_report, write_json

    params = {k: v for k, v in vars(args).items() if not callable(v)}
    env = torch_env(device)
    env.update(env_extra or {})
    doc = document(bench, rows, summary, env, params)
    doc.update(extra or {})
    print_report(doc, columns)
    print(f"wrote {write_json(args.json, doc)}")
    return doc


def save_partial(args: Any, bench: str, rows: list[dict[str, Any]], device: torch.device) -> None:
    """Write the rows so far (`"partial": true`): a benchmark killed by its time limit still leaves figures."""
    from engine.bench.report import document, write_json

    params = {k: v for k, v in vars(args).items() if not callable(v)}
    doc = document(bench, rows, {}, {"device": str(device), "torch": torch.__version__}, params)
    doc["partial"] = True
    write_json(args.json, doc)

"""Make the README's screenshots from a real run: the app launches the real strata-engine on the embedded
model, and the pictures are taken with App.save_screenshot while it runs.

  monitor-long-prompt.svg   the monitor while the seed scenario's fresh long prompt is admitted (short
                            generations decoding beside it until it is done, one slot prefilling with its
                            ETA, the history of the run so far); also at 100x30 and 80x24
  profiles.svg              the profiles screen, with one broken profile reported by path and line
  crash.svg                 the crash panel after the engine exits on a real error: on a GPU a CUDA error
                            (a device ordinal the machine does not have), on CPU a checkpoint cut short

On a GPU (`--device cuda:0`) the GPU panel has NVML's readings, and `--fault-inject RULES` (tests/fault_injection.py's
rules, installed in the engine process the app starts; injected errors are labelled so) makes graph captures fail so that the graph-cache pane
shows fail / evict / retry / wait next to the real captures. `--prefix gpu-` names the files apart.

    .venv/bin/python scripts/make_screenshots.py [--model PATH|builtin:strata-tiny] [--device cpu]
    python3 scripts/make_screenshots.py --device cuda:0 --context 262144 --chunk-tokens 2048 \
        --fault-inject capture:draft_round:1-2:oom --prefix gpu- --out $OUT/shots
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from strata_tui.app import StrataApp, create_app  # noqa: E402
from strata_tui.profiles.profile import Profile  # noqa: E402
from strata_tui.profiles.store import ProfileStore  # noqa: E402

OUT = ROOT / "screenshots"
SIZE = (160, 48)
# The seed's shorts decode until the long prompt is done (then are stopped), and the long prompt comes late enough
# for all of them to decode first on a busy CPU: the result then has their rate before it too.
SHOT_LOAD = {"short_max_tokens": 0, "delay_s": 30.0}


def default_checkpoint(workdir: Path) -> tuple[str, Path]:
    """The embedded model when it is installed, else a small random Qwen3 with an MTP head.

    Returns (the profile's model value, the checkpoint directory)."""
    import engine

    embedded = Path(engine.__file__).parent / "models" / "strata-tiny"
    if (embedded / "config.json").exists():
        return "builtin:strata-tiny", embedded
    from engine.model.random_checkpoint import write_random_checkpoint

    path = write_random_checkpoint(workdir / "tiny-mtp", mtp_layout="deepseek", seed=0)
    return str(path), path


def broken_copy(model_dir: Path, workdir: Path) -> str:
    """The same checkpoint with its weights file cut in half: the engine fails to load it with a real error."""
    broken = workdir / "truncated-checkpoint"
    shutil.copytree(model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    return str(broken)


async def wait_until(pilot, condition, timeout_s: float, what: str) -> None:
    started = time.monotonic()
    next_report = started + 10
    while not condition():
        now = time.monotonic()
        if now > started + timeout_s:
            raise SystemExit(f"make_screenshots: timed out waiting for {what}")
        if now > next_report:
            app = pilot.app
            slots = ", ".join(f"{n}:{s.state}" for n, s in sorted(app.view.monitor.slots.items()))
            print(f"  waiting for {what} ({now - started:.0f} s): engine {app.view.monitor.engine_state}; "
                  f"slots {slots or 'none'}; {app.view.status_note}", file=sys.stderr, flush=True)
            next_report = now + 10
        await pilot.pause(0.05)


def long_prefill_visible(app: StrataApp) -> bool:
    """The seed report's moment: short generations decoding while a fresh long prompt is part-way in."""
    slots = app.view.monitor.slots.values()
    decoding = [s for s in slots if s.state == "decode" and s.generated_tokens >= 4]
    prefilling = [s for s in slots if s.state == "prefill" and s.prompt_tokens >= 1024 and s.prefill_tok_s
                  and 0.15 <= (s.prefilled_tokens - s.cached_tokens) / max(1, s.prompt_tokens - s.cached_tokens)
                  <= 0.85]
    return bool(prefilling) and len(decoding) >= 3


def crash_profile(args: argparse.Namespace, model: str, model_dir: Path, workdir: Path) -> Profile:
    """A profile the engine fails to start with a real error: on a GPU a device ordinal past the last GPU
    (CUDA's own `invalid device ordinal`), on CPU a checkpoint whose weights file is cut short."""
    if args.device.startswith("cuda"):
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        return Profile("crashy").with_engine(model=model, device=f"cuda:{count}")
    return Profile("crashy").with_engine(model=broken_copy(model_dir, workdir), device=args.device)


async def shoot(args: argparse.Namespace, workdir: Path) -> list[Path]:
    config_dir = workdir / "config"
    store = ProfileStore(config_dir)
    model, model_dir = (args.model, Path(args.model)) if args.model else default_checkpoint(workdir)
    seed = Profile("seed-repro").with_engine(model=model, device=args.device, batch=8, batch_mtp=True,
                                             context=args.context, prefill_chunk_tokens=args.chunk_tokens,
                                             step_token_budget=max(4096, args.chunk_tokens))
    store.save(seed)
    store.save(crash_profile(args, model, model_dir, workdir))
    (store.profiles_dir / "typo.toml").write_text('[engine]\nmodel = "builtin:strata-tiny"\nkv = "fp8"\n')
    if args.fault_inject:
        from tests.fault_injection import engine_process_env

        os.environ.update(engine_process_env(args.fault_inject))  # the engine child inherits it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = lambda stem: str(out / f"{args.prefix}{stem}.svg")  # noqa: E731
    written: list[Path] = []
    app = create_app(config_dir=config_dir, profile="seed-repro", engine_cwd=str(ROOT))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: bool(app.view.telemetry_connected), 300, "the engine to be ready")
        # The seed scenario (six short generations, then a fresh long prompt) with the shorts decoding until the
        # long prompt is done: the `l` key's short generations end before the long prompt arrives on CPU.
        app.controls.run_load("seed", overrides=SHOT_LOAD)
        await wait_until(pilot, lambda: long_prefill_visible(app), 600, "the long prompt's prefill")
        await pilot.pause(app.view.settings.refresh_s * 2)  # let the refresh tick draw it
        written.append(Path(app.save_screenshot(name("monitor-long-prompt"))))
        await pilot.resize_terminal(100, 30)
        await pilot.pause(app.view.settings.refresh_s * 2)
        written.append(Path(app.save_screenshot(name("monitor-long-prompt-100x30"))))
        await pilot.resize_terminal(80, 24)  # one lower-left panel (the log), every switch, the narrow slot columns
        await pilot.pause(app.view.settings.refresh_s * 2)
        written.append(Path(app.save_screenshot(name("monitor-long-prompt-80x24"))))
        await pilot.resize_terminal(*SIZE)
        await wait_until(pilot, lambda: app.view.load_result is not None, 1800, "the scenario's result")
        await pilot.pause(app.view.settings.refresh_s * 2)
        written.append(Path(app.save_screenshot(name("load-result"))))
        os.environ.pop("STRATA_FAULT_INJECT", None)  # later engine processes start without faults
        await pilot.press("p")
        await pilot.pause(0.3)
        await pilot.press("down", "down")
        await pilot.pause(0.3)
        written.append(Path(app.save_screenshot(name("profiles"))))
        await pilot.press("escape")
        app.use_profile(store.load("crashy"))  # relaunches with the profile that cannot start
        await wait_until(pilot, lambda: app.view.crash is not None and app.run_id >= 2, 300, "the engine to exit")
        await pilot.pause(app.view.settings.refresh_s * 3)
        written.append(Path(app.save_screenshot(name("crash"))))
        await pilot.press("q")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: builtin:strata-tiny if installed, else a "
                                        "random tiny Qwen3 with an MTP head)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--context", type=int, default=8192,
                        help="tokens per slot (the long prompt fills it; on a CPU a longer one takes many minutes)")
    parser.add_argument("--chunk-tokens", type=int, default=512,
                        help="prefill chunk: small on CPU so the long prompt's admission lasts long enough to see")
    parser.add_argument("--fault-inject", default="", help="STRATA_FAULT_INJECT rules for the seed run")
    parser.add_argument("--out", default=str(OUT), help="folder for the SVGs (default screenshots/)")
    parser.add_argument("--prefix", default="", help="file name prefix (gpu- for the GPU set)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="strata-shots-") as tmp:
        for path in asyncio.run(shoot(args, Path(tmp))):
            print("wrote", path)


if __name__ == "__main__":
    main()

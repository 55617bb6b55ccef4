"""`strata-engine bench WHAT`: argument parsing and dispatch for the benchmarks and the load scenarios.

Each benchmark lives in `engine/bench/<what>.py` with `run(args) -> dict` (the JSON document) and is
imported only when chosen, so `strata-engine --help` stays fast and torch-free. Every benchmark prints a
table and writes its JSON to `--json` (default `strata-bench-<what>.json`). Sizes are flags, so CI can run
each code path on CPU in seconds and the GPU driver (benchmarks/run_all_gpu.sh) at full size.
"""

from __future__ import annotations

import argparse
import importlib

from engine.config import add_engine_options
from engine.option_checks import finite_float, whole_number
from engine.errors import ConfigError

_K = 1024
BENCHES = {
    "scenario": ("engine.bench.scenario_cli", "play a named load scenario against a running server"),
    "decode": ("engine.bench.decode", "decode tok/s of the real Engine per batch size, graphs on and off"),
    "mtp": ("engine.bench.mtp", "MTP drafting on/off: acceptance per position, tokens per step, speedup"),
    "ttft": ("engine.bench.ttft", "time to first token for fresh long prompts"),
    "reuse": ("engine.bench.reuse", "time to first token of a prompt seen before (tier on the GPU or --peer-device)"),
    "admission": ("engine.bench.admission", "decode rate of running slots while a fresh long prompt is admitted"),
    "graphs": ("engine.bench.graphs", "graph capture time and MiB per graph kind (GraphCache snapshot)"),
    "switches": ("engine.bench.switches", "each opt-in switch on vs off where it claims to help"),
    "peers": ("engine.bench.peers", "HF transformers eager and static+compile, llama.cpp, and the weight-bandwidth floor"),
    "profile": ("engine.bench.profile", "where one steady decode step's time goes: host functions and kernels"),
    "experts": ("engine.bench.experts", "MoE decode tok/s and expert hit rate per expert-cache budget"),
    "experts-replay": ("engine.bench.experts_replay", "expert-cache hit rates of LRU, LFU and Belady replaying a "
                       "routing trace (recorded or synthetic; CPU, pure Python)"),
    "attention": ("engine.bench.attention", "one layer's decode and prefill-chunk attention per backend: "
                  "gather+SDPA, Triton paged, Flex"),
    "linear": ("engine.bench.linear", "a decode step's projections: cuBLAS against the FUSED_OPS skinny-matmul "
               "kernel, per weight and row count"),
    "throughput": ("engine.bench.throughput", "N concurrent requests (1..256): output tok/s, TTFT and inter-token "
                   "p50/p99 against the weights + live KV floor and a time-bounded HF peer"),
    "kvspill": ("engine.bench.kv_spill", "decode rate of slots whose KV is partly in host memory (--kv-resident) "
                "vs with room, and the PCIe floor"),
}


def int_list(text: str) -> list[int]:
    """`1,6` or `32K,128K` -> [1, 6] / [32768, 131072]; a bad item is a ConfigError naming it."""
    values = []
    for item in text.split(","):
        item = item.strip()
        scale = _K if item[-1:] in ("k", "K") else 1
        digits = item[:-1] if scale != 1 else item
        if not digits.isascii() or not digits.isdigit() or len(digits) > 12 or int(digits) <= 0:
            raise argparse.ArgumentTypeError(f"{item!r} is not a positive whole number (in {text!r})")
        values.append(int(digits) * scale)
    return values


def token_count(text: str) -> int:
    """`16K` or `16384` -> 16384 (one value of int_list's form)."""
    values = int_list(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one number")
    return values[0]


def positive_int(text: str) -> int:
    """A count of at least 1 (`3`); anything else is refused naming the value."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One sub-parser per benchmark under `bench`, each with its sizes and `--json`."""
    sub = parser.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCHES) + "}")
    for name, (_, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", default=f"strata-bench-{name}.json", metavar="PATH", help="where to write the JSON")
        _ADDERS[name](p)


def _scenario(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="scenario name (seed, burst, reuse, ...)")
    p.add_argument("--url", required=True, help="base URL of a running strata-engine serve")
    p.add_argument("--api-key", default=None, help="Bearer key when the server was started with --api-key")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="scenario parameter (repeat)")
    p.add_argument("--timeout-s", type=finite_float, default=1800.0, help="per-request read timeout")


def _engine(p: argparse.ArgumentParser, model: str | None = None) -> None:
    add_engine_options(p)
    if model is not None:
        p.set_defaults(model=model)
    p.add_argument("--warmup-steps", type=whole_number, default=4, help="engine steps run before timing starts")


def _decode(p: argparse.ArgumentParser) -> None:
    _engine(p, model="random:0.6b")
    p.add_argument("--batches", type=int_list, default=[1, 6], help="batch sizes (default 1,6)")
    p.add_argument("--prompt-tokens", type=whole_number, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=whole_number, default=256, help="tokens generated per request")
    p.add_argument("--graph-modes", default="on,off", help="on,off | on | off (CUDA graphs; CPU is always eager)")
    p.add_argument("--weight-formats", default=None, metavar="LIST",
                   help="one engine per --quantize value, e.g. off,fp8,fp8+head,int4,int4+tinygemm (+head: with "
                        "--quantize-head; +tinygemm: with --int4-decode tinygemm; default: --quantize's value)")


def _mtp(p: argparse.ArgumentParser) -> None:
    _engine(p)
    p.add_argument("--batches", type=int_list, default=[1], help="batch sizes (default 1)")
    p.add_argument("--prompt-tokens", type=whole_number, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=whole_number, default=256, help="tokens generated per request")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed runs per mode; decode_tok_s is their median")
    p.add_argument("--warmup-s", type=finite_float, default=2.0, metavar="S",
                   help="seconds of untimed decoding each engine runs before its timed runs, after one run that "
                        "captures its graphs, so that both modes are timed settled (default 2.0)")
    p.add_argument("--prompt-source", choices=("text", "random"), default="text",
                   help="text: a natural-language prompt through the tokenizer (acceptance means something); "
                        "random: random ids")


def _ttft(p: argparse.ArgumentParser) -> None:
    _engine(p, model="random:0.6b")
    p.add_argument("--prompt-sizes", type=int_list, default=[32 * _K, 128 * _K, 176 * _K],
                   help="fresh prompt lengths in tokens (default 32K,128K,176K)")


def _reuse(p: argparse.ArgumentParser) -> None:
    _engine(p, model="random:0.6b")
    p.add_argument("--prompt-sizes", type=int_list, default=[32 * _K],
                   help="prompt lengths in tokens, each sent fresh then again (default 32K)")
    p.add_argument("--pairs", type=whole_number, default=3,
                   help="distinct prompts per size, each fresh then again, one after the other; the row's figures "
                        "are the last pair's (a reused prompt's tail chunk replays a graph from its bucket's third "
                        "sight on), every pair's in the `_each` lists (default 3)")


def _admission(p: argparse.ArgumentParser) -> None:
    _engine(p, model="random:0.6b")
    p.add_argument("--slots", type=whole_number, default=6,
                   help="short generations decoding when the long prompt arrives")
    p.add_argument("--short-prompt-tokens", type=whole_number, default=128,
                   help="prompt tokens of each short generation")
    p.add_argument("--long-tokens", type=int_list, default=[176 * _K], help="fresh long prompt length(s)")
    p.add_argument("--baseline-steps", type=whole_number, default=32, help="decode steps timed before the long prompt")
    p.add_argument("--no-alone", action="store_true",
                   help="skip the first token of the same prompt length alone (the TTFT ratio's denominator)")


def _graphs(p: argparse.ArgumentParser) -> None:
    _engine(p)
    p.add_argument("--prompt-tokens", type=whole_number, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=whole_number, default=64, help="tokens generated per request (drives capture)")
    p.add_argument("--batches", type=int_list, default=[1, 6], help="batch sizes whose graphs get captured")


def _switches(p: argparse.ArgumentParser) -> None:
    _engine(p, model="random:0.6b")
    p.add_argument("--only", default="", help="comma-separated switch names (default: every registered switch)")
    p.add_argument("--batches", type=int_list, default=[1, 6], help="batch sizes (default 1,6)")
    p.add_argument("--prompt-tokens", type=whole_number, default=128, help="prompt tokens per request")
    p.add_argument("--long-prompt-tokens", type=token_count, default=32 * _K,
                   help="prompt length for switches that claim to help long-context decode")
    p.add_argument("--new-tokens", type=whole_number, default=128, help="tokens generated per request")


def _peers(p: argparse.ArgumentParser) -> None:
    _engine(p, model="random:0.6b")
    p.add_argument("--batches", type=int_list, default=[1, 6], help="batch sizes (default 1,6)")
    p.add_argument("--prompt-tokens", type=whole_number, default=128, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=whole_number, default=256, help="tokens generated per request")
    p.add_argument("--copy-mib", type=whole_number, default=1024,
                   help="size of the device-to-device copy for bandwidth")
    p.add_argument("--peer-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="HF weights dtype (default bfloat16)")
    p.add_argument("--peers", default="eager,static",
                   help="peers to run: eager, static (HF transformers), llamacpp (llama-server on the same weights "
                        "as GGUF); default eager,static")
    p.add_argument("--llama-server", default=None,
                   help="the llama-server binary of the llamacpp peer (default $STRATA_LLAMA_SERVER)")
    p.add_argument("--gguf-out", default=None,
                   help="where the llamacpp peer's GGUF export goes (default beside the checkpoint)")
    p.add_argument("--gguf-type", default="same", choices=("same", "q8_0", "q4_0"),
                   help="the llamacpp peer's export: the checkpoint's own dtype (default), or quantized by gguf's "
                        "quantizer (for one file both engines read, pass the .gguf as --model)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile the static-cache peer (CUDA only; off: static cache alone)")
    p.add_argument("--skip-strata", action="store_true", help="measure only the peers")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed calls per engine and batch after the warm-up; the median is the figure (default 3)")


def _profile(p: argparse.ArgumentParser) -> None:
    _engine(p, model="random:0.6b")
    p.set_defaults(batch=1)  # the engine's --batch: here both its slots and the decoding requests
    # 1,100 + warm-up + 4 passes of 64 steps stays inside one length bucket (1,025..2,048) at a token a step, so
    # no pass captures a graph; with MTP (up to 4 tokens a step) --steps 48 keeps it there.
    p.add_argument("--prompt-tokens", type=whole_number, default=1100, help="prompt tokens per request")
    p.add_argument("--steps", type=whole_number, default=64, help="steps per pass (phases, wall, cProfile, torch.profiler)")
    p.add_argument("--top", type=whole_number, default=25, help="host functions and kernels listed")


def _experts(p: argparse.ArgumentParser) -> None:
    _engine(p, model="random:moe-bench")
    p.set_defaults(batch=1)  # the engine's --batch: here both its slots and the decoding requests
    p.add_argument("--budgets", default="5,15,30,50,100", help="percent of the routed experts' bytes (100: all)")
    p.add_argument("--prompt-tokens", type=whole_number, default=64, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=whole_number, default=128, help="tokens generated per request")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers' eager generate on the same weights")
    p.add_argument("--trace-out", default=None, metavar="PATH", help="write the smallest budget's routing trace")
    p.add_argument("--stores", default="host", help="where the experts that do not fit are held: host, peer "
                   "(peer needs --peer-device; host,peer measures both in one run)")
    p.add_argument("--cold", default="copy", help="how a cold expert is served, each measured at every budget "
                   "below 100: copy, cpu (EXPERT_CPU), prefetch (EXPERT_PREFETCH); copy,cpu,prefetch: side by side")
    p.add_argument("--batches", type=int_list, default=None,
                   help="batch sizes, each its own set of rows (default: --batch)")
    p.add_argument("--all-resident-model", default=None, metavar="MODEL",
                   help="measure the 100%% row on this model (one whose experts all fit the card, e.g. "
                        "random:moe-80b-40l beside random:moe-80b) instead of --model")
    p.add_argument("--copy-mib", type=int, default=1024,
                   help="size of the device-to-device copy that measures the bandwidth of the floor")
    p.add_argument("--kernels", type=int_list, default=None, metavar="TOKENS,...",
                   help="time one sparse layer's routed experts per backend (Triton, torch._grouped_mm, the "
                        "per-route gather) at these token counts instead of running engines")
    p.add_argument("--moe-tune", default="", help="with --kernels: the Triton kernels' launch shapes to time too, "
                   "BLOCK_MxGATE_UP_NxDOWN_NxBLOCK_KxWARPSxSTAGES,... (16x32x64x128x4x4)")
    p.add_argument("--iters", type=int, default=20, help="with --kernels: layers per captured graph")


def _experts_replay(p: argparse.ArgumentParser) -> None:
    from engine.bench.experts_replay import add_arguments as add  # torch-free

    add(p)


def _attention(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cuda:N, cpu or auto")
    p.add_argument("--contexts", type=int_list, default=[4 * _K, 32 * _K, 128 * _K], help="context tokens (4K,32K)")
    p.add_argument("--batches", type=int_list, default=[1, 8], help="rows per read")
    p.add_argument("--q-lens", type=int_list, default=[1, 4], help="queries per row (1 decode, K+1 verify)")
    p.add_argument("--kv-storage", default="bf16,int8", help="KV storage kinds: bf16, int8")
    p.add_argument("--backends", default="torch,triton,flex", help="torch, triton (CUDA), flex (CUDA, bf16); "
                   "prefill rows also cudnn, flash (CUDA: vendor SDPA over the gathered prefix), cudnnNk / flashNk "
                   "(its keys N K at a time), dense / gather_dense (CUDA: a Triton flash kernel over contiguous "
                   "keys, gathered once / in every read; denseQxTxWxS at a launch shape)")
    p.add_argument("--iters", type=whole_number, default=20, help="reads per captured graph")
    p.add_argument("--tune", default="", help="kernel launch shapes to time too: "
                   "TILExWARPSxSTAGESxMIN_SPLIT_TILES[xLOADS],... (128x4x2x1, 64x4x2x1xtma)")
    p.add_argument("--rows", default="decode,prefill", help="decode (few queries per row), prefill (one chunk "
                   "over a cached prefix), or both")
    p.add_argument("--prefill-prefixes", type=int_list, default=[8 * _K, 32 * _K, 128 * _K],
                   help="cached tokens before the chunk, per prefill row (8K,32K,128K)")
    p.add_argument("--prefill-chunk", type=token_count, default=2048, help="the chunk's tokens (default 2048)")
    p.add_argument("--prefill-tune", default="",
                   help="prefill kernel launch shapes to time too: QUERIESxTILExWARPSxSTAGES[xLOADS],... "
                   "(128x64x8x2, 128x64x4x3xtma; LOADS gather, block or tma)")


def _linear(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cuda:N (the kernel is CUDA-only)")
    p.add_argument("--size", default="0.6b", help="the random model size whose weight shapes to time (0.6b)")
    p.add_argument("--rows", type=int_list, default=[1, 6, 18], help="rows per product (1,6,18)")
    p.add_argument("--iters", type=whole_number, default=50, help="products per captured graph")
    p.add_argument("--tune", default="", help="kernel launch shapes to time too: "
                   "BLOCK_NxBLOCK_KxSPLITxWARPSxSTAGES,... (32x256x1x4x4)")
    p.add_argument("--quant", default="", help="time the quantized kernels instead, against cuBLAS bf16: "
                   "a comma-separated list of fp8, fp8-block, int4, int4-g32, int8, int8-g32")
    p.add_argument("--quant-tune", default="", help="the quantized kernels' launch shapes to time too, on the 1-4 "
                   "row GEMV and the tensor-core path: BLOCK_NxBLOCK_KxSPLITxWARPSxSTAGES,... (64x128x2x4x3; "
                   "the tensor-core path's int4 also ...xpairs: two codes unpacked at a time)")
    p.add_argument("--table-out", default="", help="write the fastest measured launch shapes and row thresholds "
                   "per weight class as a launch table (merged into the file's other devices)")


def _kvspill(p: argparse.ArgumentParser) -> None:
    _engine(p, model="random:0.6b")  # --kv-resident: the spilling run's window (default 1024)
    p.add_argument("--prompt-tokens", type=token_count, default=16 * _K, help="prompt tokens per slot (default 16K)")
    p.add_argument("--new-tokens", type=whole_number, default=128, help="tokens generated per slot")
    p.add_argument("--host-fraction", type=finite_float, default=0.5,
                   help="share of a slot's non-resident KV on the host when its forward starts (default 0.5)")
    p.add_argument("--slots", type=whole_number, default=2,
                   help="slots decoding a prompt each (default 2); the pool stays sized for two, so with more "
                        "the rest of their non-resident KV is on the host too (the seed's six long prompts: 6)")


def _throughput(p: argparse.ArgumentParser) -> None:
    _engine(p, model="random:0.6b")
    p.add_argument("--concurrency", type=int_list, default=[1, 8, 32, 64, 128, 256],
                   help="concurrent requests, one engine of that many slots each (default 1,8,32,64,128,256)")
    p.add_argument("--sets", default="fixed,mixed", help="request sets: fixed (--prompt-tokens, --new-tokens), "
                   "mixed (seeded lengths in the --mixed-* ranges); default both")
    p.add_argument("--prompt-tokens", type=token_count, default=_K, help="the fixed set's prompt tokens (1K)")
    p.add_argument("--new-tokens", type=whole_number, default=256, help="the fixed set's output tokens (256)")
    p.add_argument("--mixed-prompt-tokens", type=int_list, default=[128, 8 * _K], metavar="MIN,MAX",
                   help="the mixed set's prompt tokens, uniform (default 128,8K)")
    p.add_argument("--mixed-new-tokens", type=int_list, default=[64, _K], metavar="MIN,MAX",
                   help="the mixed set's output tokens, uniform (default 64,1K)")
    p.add_argument("--seed", type=whole_number, default=0, help="the mixed set's seed")
    p.add_argument("--copy-mib", type=whole_number, default=1024,
                   help="size of the device-to-device copy for bandwidth")
    p.add_argument("--peer", default="static", choices=("static", "eager", "none"),
                   help="HF transformers' batched generate on the fixed set: static cache (+ torch.compile on "
                        "CUDA), eager, or none (default static)")
    p.add_argument("--peer-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="HF weights dtype (default bfloat16)")
    p.add_argument("--peer-timeout-s", type=finite_float, default=300.0, metavar="S",
                   help="seconds each peer call may take, its warm-up included, before it is killed and recorded "
                        "as not finished (default 300)")
    p.add_argument("--chunk-rows", default="on", choices=("on", "off"),
                   help="on: a step's prompt chunks of one length bucket run as rows of one forward (the engine's "
                        "way); off: each chunk its own forward, to measure the difference (default on)")
    p.add_argument("--peer-max-concurrency", type=positive_int, default=8, metavar="N",
                   help="the peer runs at the concurrencies up to N (default 8: each call is a fresh process that "
                        "compiles and captures graphs for its batch again)")
    p.add_argument("--warm-up", default="burst", choices=("burst", "short"),
                   help="before each row's timed burst: burst, the same N prompts (other tokens) for 4 output "
                        "tokens, so one-time work (kernels compiled, graphs captured, the KV pool sized) happens "
                        "before the clock starts, as on a server that has served before; short, two requests of "
                        "8 tokens: a fresh engine's first burst (default burst)")
    p.add_argument("--slow-steps", type=whole_number, default=0, metavar="N",
                   help="report each row's N slowest engine steps of the timed burst, with the events the engine "
                        "published during each (graph captures, the tier giving blocks back, KV pool growths, ...): "
                        "in the JSON row's slow_steps and printed after the table (default 0: none)")
    p.add_argument("--slow-steps-profile", action="store_true",
                   help="with --slow-steps: every step of the timed burst under cProfile, and each slow step lists "
                        "the host functions it spent its own time in (every step's host work is slower: a "
                        "diagnosis, not a figure)")


_ADDERS = {
    "scenario": _scenario, "decode": _decode, "mtp": _mtp, "ttft": _ttft, "reuse": _reuse, "admission": _admission,
    "graphs": _graphs, "switches": _switches, "peers": _peers, "profile": _profile, "experts": _experts,
    "experts-replay": _experts_replay,
    "attention": _attention, "linear": _linear, "kvspill": _kvspill, "throughput": _throughput,
}


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; it prints its table and writes its JSON. Returns the exit status."""
    for name in ("warmup_steps", "prompt_tokens", "new_tokens", "slots", "short_prompt_tokens", "baseline_steps",
                 "copy_mib", "steps", "top"):
        value = getattr(args, name, None)
        if value is not None and (value < 0 or (value == 0 and name != "warmup_steps")):
            raise ConfigError(name, value, "expected a positive whole number")
    warmup_s = getattr(args, "warmup_s", None)
    if warmup_s is not None and not 0.0 <= warmup_s <= 600.0:
        raise ConfigError("warmup_s", warmup_s, "expected seconds between 0 and 600")
    module = importlib.import_module(BENCHES[args.bench][0])
    return int(module.run(args) or 0)

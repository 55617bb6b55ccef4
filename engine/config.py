"""EngineConfig: every option of `strata-engine serve`, validated in one place. Torch-free.

The TUI builds an EngineConfig from a profile's `[engine]` section, validates it with the same rules the
engine uses, and turns it into argv with `to_argv()`; the engine's CLI parses argv back into one. So a
profile that the TUI accepts is one the engine accepts.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from engine.errors import ConfigError
from engine.option_checks import (check_expert_cache_mib, check_positive, check_vram_reserve_mib,
                                  coerce_option, finite_float, whole_number)
from engine.switches import switches_from_env

BUILTIN_MODEL = "builtin:strata-tiny"
KV_DTYPES = ("bf16", "int8")
PREFILL_OVERLAP_MODES = ("auto", "on", "off")
DECODE_AHEAD_MODES = ("auto", "on", "off")
KV_POOL_MODES = ("auto", "by-use", "reserved")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error")
QUANTIZE_FORMATS = ("fp8", "fp8-block", "int4")
QUANTIZE_MODES = ("off",) + QUANTIZE_FORMATS
INT4_DECODE_KERNELS = ("strata", "tinygemm")
MAX_CONTEXT_TOKENS = 262144
DEFAULT_VRAM_RESERVE_MIB = 1024
# A 262,144-token prompt as JSON: token ids take at most 7 bytes each (1.8 MiB); text about 4 bytes a token,
# up to 6 a character when escaped (\uXXXX). 8 MiB holds either; a bigger body is refused before parsing.
DEFAULT_MAX_BODY_MIB = 8
# a 176K prompt in 2,048-token chunks: 11 windows of 8 chunks (13 as they ramp up beside decoding slots), so a
# cold expert crosses 11 times, not 86 (engine.exec.prefill_window); the window's MoE holds (top_k + 6) x hidden
# activations a token at once
DEFAULT_PREFILL_WINDOW_TOKENS = 16384
API_KEY_ENV = "STRATA_API_KEY"
REDACTED = "<redacted>"  # what the config's serialized form shows instead of a secret
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_CUDA_RE = re.compile(r"^cuda(:\d+)?$")


MAX_QUEUE = 1 << 16  # requests waiting for a slot; each holds its prompt in memory
MAX_TIER_WAIT_POLLS = 10_000
MAX_TIER_WAIT_INTERVAL_S = 60.0


def _opt(help: str, *, metavar: str | None = None, choices: tuple[str, ...] | None = None, group: str = "engine",
         flag: str | None = None) -> dict[str, Any]:
    """An option's one description (field metadata): the CLI's argparse options and strata-tui's profile
    editor are both generated from it. group: "engine" (serve, generate, bench) or "server" (serve only)."""
    return {"help": help, "metavar": metavar, "choices": choices, "group": group, "flag": flag}


def mode_wanted(option: str, mode: str, auto: bool, blocked: str | None = None) -> bool:
    """An `auto | on | off` option's answer: `off` never; `on` wherever nothing blocks it; `auto` where `auto`
    and nothing blocks it. `blocked` says why it cannot work here: `on` is then a ConfigError naming the option."""
    if mode == "off":
        return False
    if blocked is not None:
        if mode == "on":
            raise ConfigError(option, mode, blocked)
        return False
    return mode == "on" or auto


@dataclass(frozen=True)
class EngineConfig:
    """The engine's options. Field names are the CLI's long options with `-` as `_`."""

    model: str = field(default=BUILTIN_MODEL, metadata=_opt(f"checkpoint directory or {BUILTIN_MODEL}", metavar="PATH"))
    device: str = field(default="auto", metadata=_opt("auto | cpu | cuda:N", metavar="DEVICE"))
    dtype: str = field(default="auto", metadata=_opt("weights dtype (auto: bf16 on CUDA, fp32 on CPU)",
                                                      choices=MODEL_DTYPES))
    quantize: str = field(default="off", metadata=_opt(
        "round a 16/32-bit checkpoint's projections to nearest at load: fp8 (e4m3, a scale per channel), fp8-block "
        "(a scale per 128x128 block, as Qwen's FP8 checkpoints) or int4 (a scale and zero point per group of 128); "
        "`strata-engine quantize` writes the result once",
        choices=QUANTIZE_MODES))
    quantize_head: bool = field(default=False, metadata=_opt(
        "the LM head in FP8 at load (e4m3, a scale per vocabulary row; the embeddings stay as loaded): the head is "
        "the largest weight a decode step reads"))
    int4_decode: str = field(default="strata", metadata=_opt(
        "the kernel of CUDA decode and verify steps of 1-4 sequences on int4 weights: strata (this engine's GEMV) or "
        "tinygemm (PyTorch's int4 kernel: faster at those batches, but it holds the int4 codes a second time in its "
        "own layout, counted in the VRAM books; docs/MODEL.md)", choices=INT4_DECODE_KERNELS))
    batch: int = field(default=4, metadata=_opt("concurrent request slots", metavar="N"))
    batch_mtp: bool = field(default=False, metadata=_opt("batched MTP speculative drafting for all decoding slots"))
    mtp_depth: int = field(default=1, metadata=_opt("draft tokens per MTP round", metavar="K"))
    kv: str = field(default="bf16", metadata=_opt("KV cache dtype", choices=KV_DTYPES))
    kv_pool: str = field(default="auto", metadata=_opt(
        "how slots hold KV: by-use (one pool of blocks; a slot takes blocks as its tokens need them and gives them "
        "back when its request ends, --context is a per-request limit) or reserved (every slot holds its whole "
        "context from the start); auto: by-use (docs/KV.md)", choices=KV_POOL_MODES))
    # None: no guaranteed window (KV by use) or every slot's whole context (reserved): docs/VRAM.md
    kv_resident: int | None = field(default=None, metadata=_opt(
        "tokens of each slot's KV guaranteed in VRAM (reserved at start, counted in the VRAM books); tokens past "
        "them take blocks from a shared pool that grows from the prefix-cache tier, and spill to host memory "
        "when even that is short (lossless). Default: no guaranteed window (--kv-pool decides how slots hold KV)",
        metavar="TOKENS"))
    context: int = field(default=8192, metadata=_opt("context per slot", metavar="TOKENS"))
    vram_reserve_mib: int = field(default=DEFAULT_VRAM_RESERVE_MIB, metadata=_opt("VRAM the engine never takes",
                                                                                  metavar="MIB"))
    expert_cache_mib: int | str | None = field(default=None, metadata=_opt(
        "MoE models: MiB of GPU slots for routed experts (the rest in pinned host memory, or on --peer-device), or "
        "auto (what the VRAM books leave); default: every expert on the GPU", metavar="MIB|auto"))
    peer_device: str | None = field(default=None, metadata=_opt(
        "second GPU for the prefix-cache tier and an MoE model's expert store", metavar="cuda:N"))
    host: str = field(default="127.0.0.1", metadata=_opt("address to bind", group="server"))
    port: int = field(default=0, metadata=_opt("port (0 picks a free one)", group="server"))
    # A secret: not in repr, redacted by to_dict, never in to_argv (secret_env carries it).
    api_key: str | None = field(default=None, repr=False, metadata=_opt(
        "require Authorization: Bearer KEY on every route but /health (default: $STRATA_API_KEY, which keeps it "
        "off the process list)", metavar="KEY", group="server"))
    max_body_mib: int = field(default=DEFAULT_MAX_BODY_MIB, metadata=_opt(
        "request bodies above this get 413 before they are parsed", metavar="MIB", group="server"))
    log_level: str = field(default="info", metadata=_opt("stderr log level", choices=LOG_LEVELS, group="server"))
    queue_max: int = field(default=256, metadata=_opt("bounded request queue length", metavar="N"))
    prefill_chunk_tokens: int = field(default=2048, metadata=_opt("prompt tokens per prefill chunk", metavar="TOKENS"))
    # None: sized at start to the device's measured matmul rate and the model (engine.core.step_budget)
    step_token_budget: int | None = field(default=None, metadata=_opt(
        "tokens one engine step may process (default: the tokens the device prefills in about 50 ms for this "
        "model, 4096..16384, never below --prefill-chunk-tokens)", metavar="TOKENS"))
    prefill_window_tokens: int = field(default=DEFAULT_PREFILL_WINDOW_TOKENS, metadata=_opt(
        "MoE models whose experts do not all fit the expert cache: a long prompt's chunks run layer by layer over "
        "windows of up to this many tokens, so a cold expert is copied to the device once per window and layer "
        "instead of once per chunk; the window's activations grow with it (0: chunk by chunk)", metavar="TOKENS"))
    prefill_overlap: str = field(default="auto", metadata=_opt(
        "prompt chunks on a side stream beside the decoding slots' steps (auto: on CUDA, unless "
        "an MoE model; on: also on a CPU, whose one stream runs each whole chunk unpaced, landing a step late: for "
        "tests; off: between the steps, paced)", choices=PREFILL_OVERLAP_MODES))
    decode_ahead: str = field(default="auto", metadata=_opt(
        "launch the next decode step (or MTP's fused step) before this one's tokens reach the host when every "
        "decoding slot is greedy, so the host's work overlaps the device's (auto: with CUDA graphs, unless "
        "an MoE model; on: also eagerly and on a CPU, for tests; off: never)",
        choices=DECODE_AHEAD_MODES))
    # CUDA graphs where the device has them; CPU always runs eagerly
    graphs: bool = field(default=True, metadata=_opt("CUDA graphs on GPU", flag="both"))
    tier_wait_polls: int = field(default=20, metadata=_opt("polls for tier room after a graph OOM", metavar="N"))
    tier_wait_interval_s: float = field(default=0.08, metadata=_opt("seconds between those polls", metavar="S"))
    switches: Mapping[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.expert_cache_mib, str) and self.expert_cache_mib.strip().isdigit():
            object.__setattr__(self, "expert_cache_mib", int(self.expert_cache_mib))  # argv / TOML text
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first parameter and value that cannot work."""
        check_positive("batch", self.batch, upper=256)
        check_positive("mtp_depth", self.mtp_depth, upper=8)
        check_positive("context", self.context, upper=MAX_CONTEXT_TOKENS)
        check_positive("queue_max", self.queue_max, upper=MAX_QUEUE)
        check_positive("prefill_chunk_tokens", self.prefill_chunk_tokens, upper=MAX_CONTEXT_TOKENS)
        check_positive("prefill_window_tokens", self.prefill_window_tokens, upper=MAX_CONTEXT_TOKENS, lower=0)
        if self.step_token_budget is not None:
            check_positive("step_token_budget", self.step_token_budget, upper=MAX_CONTEXT_TOKENS)
        check_positive("tier_wait_polls", self.tier_wait_polls, upper=MAX_TIER_WAIT_POLLS, lower=0)
        check_positive("max_body_mib", self.max_body_mib, upper=1024)
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()
                                             and self.api_key.strip() == self.api_key):
            # HTTP headers carry ASCII: a client could never send this key. The value itself is never echoed.
            raise ConfigError("api_key", REDACTED, "expected printable ASCII without surrounding spaces "
                                                   "(an HTTP header cannot carry anything else)")
        if not self.model:
            raise ConfigError("model", self.model, "a checkpoint directory or builtin:strata-tiny is required")
        if not _DEVICE_RE.match(self.device):
            raise ConfigError("device", self.device, "expected auto, cpu or cuda:N")
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError("dtype", self.dtype, f"expected one of {', '.join(MODEL_DTYPES)}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("log_level", self.log_level, f"expected one of {', '.join(LOG_LEVELS)}")
        if self.quantize not in QUANTIZE_MODES:
            raise ConfigError("quantize", self.quantize, f"expected one of {', '.join(QUANTIZE_MODES)}")
        if self.int4_decode not in INT4_DECODE_KERNELS:
            raise ConfigError("int4_decode", self.int4_decode, f"expected one of {', '.join(INT4_DECODE_KERNELS)}")
        if self.kv not in KV_DTYPES:
            raise ConfigError("kv", self.kv, f"expected one of {', '.join(KV_DTYPES)}")
        if self.decode_ahead not in DECODE_AHEAD_MODES:
            raise ConfigError("decode_ahead", self.decode_ahead, f"expected one of {', '.join(DECODE_AHEAD_MODES)}")
        if self.prefill_overlap not in PREFILL_OVERLAP_MODES:
            raise ConfigError("prefill_overlap", self.prefill_overlap,
                              f"expected one of {', '.join(PREFILL_OVERLAP_MODES)}")
        if self.kv_pool not in KV_POOL_MODES:
            raise ConfigError("kv_pool", self.kv_pool, f"expected one of {', '.join(KV_POOL_MODES)}")
        if self.kv_resident is not None:
            check_positive("kv_resident", self.kv_resident, upper=self.context)
            if self.kv_pool == "reserved":
                raise ConfigError("kv_pool", self.kv_pool, "--kv-resident takes blocks by use past its window: "
                                                           "use --kv-pool by-use or auto")
        check_vram_reserve_mib(self.vram_reserve_mib)
        if self.expert_cache_mib is not None and self.expert_cache_mib != "auto":
            value = self.expert_cache_mib
            check_expert_cache_mib(value, "expert_cache_mib", " or auto (what the VRAM books leave)")
        if self.peer_device is not None and not _CUDA_RE.match(self.peer_device):
            raise ConfigError("peer_device", self.peer_device, "expected cuda:N")
        if not (0 <= self.port <= 65535):
            raise ConfigError("port", self.port, "expected 0..65535 (0 picks a free port)")
        if not self.host:
            raise ConfigError("host", self.host, "an address to bind is required")
        if self.step_token_budget is not None and self.prefill_chunk_tokens > self.step_token_budget:
            raise ConfigError(
                "prefill_chunk_tokens",
                self.prefill_chunk_tokens,
                f"must not exceed step_token_budget ({self.step_token_budget})",
            )
        interval = self.tier_wait_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not math.isfinite(interval) \
                or not 0 <= interval <= MAX_TIER_WAIT_INTERVAL_S:
            raise ConfigError("tier_wait_interval_s", interval, f"expected a number of seconds, "
                                                                f"0..{MAX_TIER_WAIT_INTERVAL_S:.0f}")
        from engine.switches import get_switch

        for name in self.switches:
            get_switch(name)  # raises UnknownSwitch naming the typo

    def kv_by_use(self) -> bool:
        """Whether slots take KV blocks by use (`kv_pool`; `--kv-resident` implies it), on every device."""
        return self.kv_resident is not None or self.kv_pool != "reserved"

    @staticmethod
    def options() -> list[Any]:
        """Every option's field (name, type, default, metadata["help"/"metavar"/"choices"/"group"/"flag"])."""
        return [f for f in fields(EngineConfig) if f.metadata]

    # --- conversions -------------------------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "EngineConfig":
        """Build from a dict (a profile's [engine] section); unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        for key in values:
            if key.replace("-", "_") not in known:
                raise ConfigError(key, values[key], f"unknown engine option; known: {', '.join(sorted(known))}")
        clean = {k.replace("-", "_"): v for k, v in values.items()}
        for f in fields(cls):
            if f.name in clean:
                clean[f.name] = coerce_option(f.name, f.type, clean[f.name])
        return cls(**clean)

    def to_dict(self, reveal_secrets: bool = False) -> dict[str, Any]:
        """Every option as a dict. The API key shows as REDACTED unless `reveal_secrets` (a profile file that
        a person saves needs the key; /strata/state, logs and events never do)."""
        data = asdict(self)
        data["switches"] = dict(self.switches)
        if self.api_key is not None and not reveal_secrets:
            data["api_key"] = REDACTED
        return data

    def to_argv(self) -> list[str]:
        """The `serve` options that differ from the defaults, as argv (switches and the API key go in the
        environment: a process list shows argv to every user of the machine)."""
        default = EngineConfig()
        argv: list[str] = []
        for f in fields(self):
            if f.name in ("switches", "api_key"):
                continue
            value = getattr(self, f.name)
            if value == getattr(default, f.name) and f.name not in ("model",):
                continue
            opt = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                if f.name == "graphs":
                    argv.append("--graphs" if value else "--no-graphs")
                elif value:
                    argv.append(opt)
            elif value is not None:
                argv += [opt, str(value)]
        return argv

    def switch_env(self) -> dict[str, str]:
        """`STRATA_<NAME>` variables for the switches this config turns on or off explicitly."""
        from engine.switches import get_switch

        return {get_switch(n).env_var: "1" if on else "0" for n, on in self.switches.items()}

    def secret_env(self) -> dict[str, str]:
        """`STRATA_API_KEY` when a key is set: how a launcher hands the key to `serve` without argv."""
        return {API_KEY_ENV: self.api_key} if self.api_key else {}


_ARG_TYPES = {"int": whole_number, "int | None": whole_number, "float": finite_float, "str": str, "str | None": str,
              "int | str | None": str}  # a number or a word (expert_cache_mib: N or auto): EngineConfig decides


def add_engine_options(parser: argparse.ArgumentParser, serving: bool = False) -> None:
    """The options of serve, generate and bench, generated from EngineConfig's fields (their metadata is each
    option's one description; strata-tui's profile editor reads the same). `serving` adds the server group."""
    defaults = EngineConfig()
    groups = {"engine": parser.add_argument_group("model and engine")}
    if serving:
        groups["server"] = parser.add_argument_group("server")
    for f in EngineConfig.options():
        meta = f.metadata
        group = groups.get(meta["group"])
        if group is None:
            continue
        default = getattr(defaults, f.name)
        if f.name == "api_key":
            default = os.environ.get(API_KEY_ENV)  # a key on argv would show in every process list
        shown = "" if default in (None, False) or meta["flag"] else f" (default {default})"
        opt = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            action = argparse.BooleanOptionalAction if meta["flag"] == "both" else "store_true"
            group.add_argument(opt, action=action, default=default, help=meta["help"] + shown)
        else:
            group.add_argument(opt, type=_ARG_TYPES[f.type], default=default, choices=meta["choices"],
                               metavar=meta["metavar"], help=meta["help"] + shown)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed options (the inverse of `to_argv`) plus `STRATA_*` switches from the environment."""
    values = {k: v for k, v in vars(args).items() if k in EngineConfig.__dataclass_fields__}
    if values.get("api_key") == "":
        # An empty key would serve without authentication while the caller believes a key is set.
        raise ConfigError("api_key", "", f"the key is empty (--api-key or {API_KEY_ENV}); unset {API_KEY_ENV} "
                                           f"and drop --api-key to serve without a key")
    return EngineConfig(**values, switches=switches_from_env(os.environ))

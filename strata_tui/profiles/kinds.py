"""Engine kinds a profile can launch: Strata itself, vLLM, SGLang and llama.cpp's `llama-server`.

`[engine] kind = "vllm"` (or "sglang", "llamacpp") makes the rest of `[engine]` that engine's own options: typed
fields (each becomes one flag of its command line, checked here so a bad value is one line naming it), plus
`extra_args` (a list of strings appended as they are) and `endpoints` (more servers to watch beside the one
launched: data-parallel replicas, other hosts). `[env]` (strings) goes into the engine's environment. The
command line is built here, never through a shell; a program that is not on PATH is refused with one line.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Mapping

from engine.errors import ConfigError

KINDS = ("strata", "vllm", "sglang", "llamacpp")
KIND_NAMES = {"strata": "Strata", "vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp"}


@dataclass(frozen=True)
class Option:
    """One typed option: its TOML key, its type, the flag it becomes, and what the editor says about it.
    `flag_off` is written for an explicit false (vLLM's --no-enable-prefix-caching); a bool without one is
    written only when true."""

    key: str
    type: type
    flag: str
    help: str
    default: Any = None
    flag_off: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class KindSpec:
    kind: str
    program: tuple[str, ...]  # the default command before the options (`program` in the profile replaces it)
    model_flag: str | None  # None: the model is positional (`vllm serve MODEL`)
    health_path: str  # answers 200 once the server can take requests
    options: tuple[Option, ...]
    default_port: int


_HOSTPORT = (Option("host", str, "--host", "address to listen on", "127.0.0.1"),
             Option("port", int, "--port", "port to listen on", None, minimum=1, maximum=65535))

VLLM = KindSpec("vllm", ("vllm", "serve"), None, "/health", (
    *_HOSTPORT,
    Option("tensor_parallel_size", int, "--tensor-parallel-size", "GPUs one replica spans", minimum=1, maximum=1024),
    Option("data_parallel_size", int, "--data-parallel-size", "replicas", minimum=1, maximum=1024),
    Option("pipeline_parallel_size", int, "--pipeline-parallel-size", "pipeline stages", minimum=1, maximum=1024),
    Option("max_num_seqs", int, "--max-num-seqs", "requests in one batch at most", minimum=1, maximum=1 << 20),
    Option("max_model_len", int, "--max-model-len", "context length in tokens", minimum=1, maximum=1 << 24),
    Option("gpu_memory_utilization", float, "--gpu-memory-utilization", "share of each GPU's memory to use",
           minimum=0.01, maximum=1.0),
    Option("enable_prefix_caching", bool, "--enable-prefix-caching", "prefix caching",
           flag_off="--no-enable-prefix-caching"),
    Option("kv_cache_dtype", str, "--kv-cache-dtype", "KV cache dtype",
           choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
    Option("served_model_name", str, "--served-model-name", "the model name clients use"),
), 8000)

SGLANG = KindSpec("sglang", ("python", "-m", "sglang.launch_server"), "--model-path", "/health", (
    *_HOSTPORT,
    Option("tp", int, "--tp", "tensor-parallel size", minimum=1, maximum=1024),
    Option("dp", int, "--dp", "data-parallel size", minimum=1, maximum=1024),
    Option("max_running_requests", int, "--max-running-requests", "running requests at most",
           minimum=1, maximum=1 << 20),
    Option("context_length", int, "--context-length", "context length in tokens", minimum=1, maximum=1 << 24),
    Option("mem_fraction_static", float, "--mem-fraction-static", "share of GPU memory for weights and KV",
           minimum=0.01, maximum=1.0),
    Option("enable_metrics", bool, "--enable-metrics", "Prometheus /metrics (the monitor reads it)", True),
    Option("disable_radix_cache", bool, "--disable-radix-cache", "turn the prefix (radix) cache off"),
    Option("speculative_algorithm", str, "--speculative-algorithm", "speculative decoding",
           choices=("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")),
), 30000)

LLAMACPP = KindSpec("llamacpp", ("llama-server",), "-m", "/health", (
    *_HOSTPORT,
    Option("parallel", int, "-np", "slots (parallel sequences)", minimum=1, maximum=4096),
    Option("ctx_size", int, "-c", "context tokens over all slots", minimum=0, maximum=2**31 - 1),
    Option("n_gpu_layers", int, "-ngl", "layers on the GPU", minimum=-1, maximum=100000),
    Option("threads", int, "-t", "CPU threads", minimum=1, maximum=4096),
    Option("batch_size", int, "-b", "logical batch size", minimum=1, maximum=1 << 20),
    Option("slots", bool, "--slots", "the /slots endpoint (the monitor's slot rows)", True, flag_off="--no-slots"),
    Option("metrics", bool, "--metrics", "Prometheus /metrics (the monitor reads it)", True),
    Option("cont_batching", bool, "--cont-batching", "continuous batching", flag_off="--no-cont-batching"),
), 8080)

SPECS = {spec.kind: spec for spec in (VLLM, SGLANG, LLAMACPP)}
_COMMON_KEYS = ("model", "program", "extra_args", "endpoints", "api_key")
_URL = re.compile(r"^https?://[^\s/]+(/\S*)?$")


@dataclass(frozen=True)
class ForeignEngine:
    """A profile's non-Strata engine: its kind, model, typed options, free extra arguments, environment and
    the other endpoints to watch."""

    kind: str
    model: str
    options: Mapping[str, Any] = field(default_factory=dict)
    program: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    endpoints: tuple[str, ...] = ()
    api_key: str | None = None

    @property
    def spec(self) -> KindSpec:
        return SPECS[self.kind]

    @property
    def name(self) -> str:
        return KIND_NAMES[self.kind]

    @property
    def port(self) -> int:
        return int(self.options.get("port") or self.spec.default_port)

    @property
    def url(self) -> str:
        """Where the launched server answers (0.0.0.0 is asked on loopback)."""
        host = str(self.options.get("host") or "127.0.0.1")
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        return f"http://{host}:{self.port}"

    def argv(self) -> list[str]:
        spec = self.spec
        argv = list(self.program or spec.program)
        argv += [spec.model_flag, self.model] if spec.model_flag else [self.model]
        values = {"port": spec.default_port, **self.options}
        for option in spec.options:
            value = values.get(option.key, option.default)
            if value is None:
                continue
            if option.type is bool:
                if value:
                    argv.append(option.flag)
                elif option.flag_off:
                    argv.append(option.flag_off)
            else:
                argv += [option.flag, str(value)]
        return argv + list(self.extra_args)

    def child_env(self, base: Mapping[str, str]) -> dict[str, str]:
        env = dict(base)
        env.update(self.env)
        if self.api_key:  # in the environment, never in argv (ps shows argv to everyone)
            env.setdefault({"vllm": "VLLM_API_KEY", "llamacpp": "LLAMA_API_KEY"}[self.kind], self.api_key)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def missing_program(self, path: str | None = None) -> str | None:
        """One line naming the program when it is not on PATH (or not executable), else None."""
        program = (self.program or self.spec.program)[0]
        if shutil.which(program, path=path) is None:
            return f"{self.name} not launched: '{program}' not found on PATH (set [engine] program to its path)"
        return None

    def to_table(self) -> dict[str, Any]:
        table: dict[str, Any] = {"kind": self.kind, "model": self.model}
        if self.program:
            table["program"] = list(self.program)
        table.update({k: v for k, v in self.options.items() if v is not None})
        if self.extra_args:
            table["extra_args"] = list(self.extra_args)
        if self.endpoints:
            table["endpoints"] = list(self.endpoints)
        if self.api_key:
            table["api_key"] = self.api_key
        return table


def parse_foreign(kind: str, values: Mapping[str, Any], env: Mapping[str, Any]) -> ForeignEngine:
    """Validate one non-Strata `[engine]` table and its `[env]`; raises ConfigError naming the key and value
    (the key `env.NAME` for the environment)."""
    if kind not in SPECS:
        raise ConfigError("kind", kind, f"expected one of {', '.join(KINDS)}")
    spec = SPECS[kind]
    by_key = {o.key: o for o in spec.options}
    options: dict[str, Any] = {}
    for key, value in values.items():
        key = key.replace("-", "_")
        if key in _COMMON_KEYS:
            continue
        option = by_key.get(key)
        if option is None:
            known = ", ".join([*_COMMON_KEYS, *by_key])
            raise ConfigError(key, value, f"not an option of kind {kind}; known: {known} (others: extra_args)")
        options[key] = _check(option, value)
    model = values.get("model")
    if not isinstance(model, str) or not model.strip():
        raise ConfigError("model", model, f"kind {kind} needs a model (a path, a GGUF file or a hub name)")
    program = _strings("program", values.get("program", ()), allow_str=True)
    extra = _strings("extra_args", values.get("extra_args", ()))
    endpoints = _strings("endpoints", values.get("endpoints", ()))
    for url in endpoints:
        if not _URL.match(url):
            raise ConfigError("endpoints", url, "expected http://HOST:PORT")
    env_out = env_table(env)
    api_key = values.get("api_key")
    if api_key is not None and not isinstance(api_key, str):
        raise ConfigError("api_key", api_key, "expected a string")
    if api_key and kind == "sglang":  # vLLM and llama.cpp read theirs from the environment; SGLang only from argv
        raise ConfigError("api_key", "***", "SGLang reads its key only from its command line, where ps shows it: "
                                            "put --api-key in extra_args if you accept that")
    return ForeignEngine(kind, model, options, program, extra, env_out, endpoints, api_key or None)


def env_table(env: Mapping[str, Any]) -> dict[str, str]:
    """`[env]`: NAME = "value" (numbers are written as they read); raises ConfigError naming `env.NAME`."""
    out: dict[str, str] = {}
    for name, value in env.items():
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"env.{name}", value, "expected a string")
        out[str(name)] = str(value)
    return out


def _check(option: Option, value: Any) -> Any:
    if option.type is bool:
        if not isinstance(value, bool):
            raise ConfigError(option.key, value, "expected true or false")
        return value
    if option.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(option.key, value, "expected a whole number")
    elif option.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(option.key, value, "expected a number")
        value = float(value)
    elif not isinstance(value, str) or not value:
        raise ConfigError(option.key, value, "expected a string")
    if option.choices and value not in option.choices:
        raise ConfigError(option.key, value, f"expected one of {', '.join(option.choices)}")
    if option.minimum is not None and value < option.minimum or option.maximum is not None and value > option.maximum:
        raise ConfigError(option.key, value, f"expected {option.minimum:g}..{option.maximum:g}")
    return value


def _strings(key: str, value: Any, allow_str: bool = False) -> tuple[str, ...]:
    if allow_str and isinstance(value, str):
        value = value.split()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(key, value, "expected a list of strings")
    return tuple(value)

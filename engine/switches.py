"""The opt-in switch registry and its run-time state. Torch-free: the TUI and the server import it.

A switch is an alternative code path that helps somewhere (measured in `docs/SWITCHES.md` and the
benchmarks). It is off unless the environment variable `STRATA_<NAME>=1` is set at start, except a switch whose
`default` is on (a measured winner): `STRATA_<NAME>=0` turns that one off. Switches marked
`live` can also be toggled on a running engine through `POST /strata/switches/{NAME}`; the others are read
at start only. A switch whose code path fails at run time is *degraded*: turned off for the rest of the run,
with the reason kept, instead of the engine exiting (the seed report's failure).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Mapping

from engine.errors import SwitchNeedsRestart, UnknownSwitch
from engine.telemetry import EventBus, SwitchEvent, WarningEvent

ENV_PREFIX = "STRATA_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


@dataclass(frozen=True)
class Switch:
    """One opt-in switch: what it is, whether it can change live, and what it was measured to do."""

    name: str
    description: str
    live: bool
    effect: str = "not yet measured"  # in words; the figures live in docs/SWITCHES.md
    default: bool = False  # the state when its variable is not set (a measured winner is on by default)
    key_tag: str = ""  # how a graph key built on its path says so in events (short: the TUI's key column)
    # applies to mixture-of-experts models only: a dense engine marks it unavailable, the monitor lists it for MoE
    moe_only: bool = False

    @property
    def tag(self) -> str:
        return self.key_tag or self.name.lower()

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name


SWITCHES: tuple[Switch, ...] = (
    Switch(
        "SPLIT_ATTN",
        "split-KV (flash-decoding) attention for long-context decode; its scratch grows with context",
        live=True,
        key_tag="split",
        effect="slower at 16K context; where it pays off is not measured yet (docs/SWITCHES.md)",
    ),
    Switch(
        "FUSED_PROJ",
        "fuse the q/k/v and gate/up projections into one matmul each (weights concatenated at load)",
        live=False,
        effect="on by default: fewer, wider matmuls make batch-1 and batch-6 decode steps faster (docs/SWITCHES.md)",
        default=True,
    ),
    Switch(
        "CAPTURE_ALL",
        "capture every decode/verify/drafter graph bucket at start instead of lazily on first need",
        live=False,
        effect="no capture stall on the first request of a bucket; the captures move to start-up (docs/SWITCHES.md)",
    ),
    Switch(
        "PINNED_STAGING",
        "stage step inputs through pinned host buffers and copy them to the device asynchronously",
        live=False,
        effect="no measurable effect on decode; a decode step launched ahead (--decode-ahead) stages this way "
               "whatever the switch says (docs/SWITCHES.md)",
    ),
    Switch(
        "COMPILE",
        "torch.compile the step functions before graph capture (slower start, faster steps)",
        live=False,
        effect="faster decode with FUSED_PROJ; a much slower start-up (docs/SWITCHES.md)",
    ),
    Switch(
        "PAGED_ATTN",
        "decode, verify and drafting attention read the paged KV pool in place (Triton kernels, CUDA only; "
        "elsewhere the PyTorch reference gathers the keys first)",
        live=True,
        key_tag="paged",
        effect="on by default: reading the KV in place makes decode attention several times faster than gather "
               "+ SDPA, most at long context (docs/SWITCHES.md)",
        default=True,
    ),
    Switch(
        "PAGED_PREFILL",
        "prompt chunks read the paged KV pool in place too: a Triton flash kernel over the cached prefix and the "
        "chunk instead of gathering the span first (needs PAGED_ATTN; CUDA only)",
        live=True,
        key_tag="pprefill",
        effect="on by default: reading the cached prefix in place makes prompt chunks faster than gather + flash "
               "SDPA, and fresh prompts' first token sooner (docs/SWITCHES.md)",
        default=True,
    ),
    Switch(
        "SHARED_PREFIX",
        "the prefix-cache tier keeps its blocks in the KV pool: a reused prefix is mapped into the slot's block "
        "table, not copied, and a finished prompt's blocks are handed to the tier, not copied (tier on the compute "
        "device, without --kv-resident)",
        live=False,
        effect="on by default: a reused prefix is mapped, not copied, so its first token comes several times "
               "sooner (docs/SWITCHES.md)",
        default=True,
    ),
    Switch(
        "EXPERT_LFU",
        "MoE expert cache: evict the expert with the smallest decayed use count (LRFU, halving every 64 of the "
        "layer's accesses) instead of the least recently used one",
        live=True,
        effect="higher expert hit rate than LRU on a skewed synthetic routing trace, equal on uniform (random-weight) "
               "routing; CPU trace replays, not yet measured on a real model's trace (docs/SWITCHES.md)",
        moe_only=True,
    ),
    Switch(
        "EXPERT_CPU",
        "MoE expert cache: a cold (not resident) expert runs on the CPU from the host store this step, as llama.cpp's "
        "--n-cpu-moe, and is copied to its slot behind the step instead of the step waiting for the copy",
        live=False,
        moe_only=True,
    ),
    Switch(
        "EXPERT_PREFETCH",
        "MoE expert cache: layer L+1's gate applied to layer L's input predicts L+1's experts, and the cold ones are "
        "copied in on the side stream while layer L runs (after a captured step's miss: before the replay)",
        live=False,
        moe_only=True,
    ),
    Switch(
        "FUSED_OPS",
        "a decoder layer's elementwise chains as one Triton kernel each: residual add + RMSNorm, q/k norm + RoPE, "
        "SiLU * up, and the KV write with int8 quantization; a decode step's narrow projections (o, down) as a "
        "skinny matmul (CUDA only; elsewhere the PyTorch ops run)",
        live=False,
        effect="on by default: fewer kernels per decode step (docs/SWITCHES.md)",
        default=True,
    ),
)

_BY_NAME = {s.name: s for s in SWITCHES}


def switch_names() -> list[str]:
    return [s.name for s in SWITCHES]


def get_switch(name: str) -> Switch:
    """Look a switch up by its name (`SPLIT_ATTN`) or its variable (`STRATA_SPLIT_ATTN`)."""
    key = name.upper()
    if key.startswith(ENV_PREFIX):
        key = key[len(ENV_PREFIX) :]
    try:
        return _BY_NAME[key]
    except KeyError:
        raise UnknownSwitch(name, switch_names()) from None


def parse_flag(var: str, raw: str) -> bool:
    """Read one `STRATA_*` value; anything but a clear yes/no is an error naming the variable."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    from engine.errors import ConfigError

    raise ConfigError(var, raw, "expected 1/0, true/false, yes/no or on/off")


def switches_from_env(environ: Mapping[str, str]) -> dict[str, bool]:
    """The switches an environment mapping sets explicitly (`STRATA_<NAME>` present), with their values; the rest
    take their default (SwitchBoard.from_values). Kept apart so that the engine can tell a switch someone asked
    for (a WARNING when it cannot apply) from one that is merely on by default (marked unavailable quietly)."""
    return {s.name: parse_flag(s.env_var, environ[s.env_var]) for s in SWITCHES if s.env_var in environ}


@dataclass
class SwitchState:
    """A switch's state on a running engine."""

    name: str
    enabled: bool
    degraded: bool = False
    reason: str = ""
    # degraded because its code path cannot run on this engine at all (not because it failed): clients say "n/a"
    unavailable: bool = False

    def to_json(self) -> dict:
        sw = _BY_NAME[self.name]
        return {
            "name": self.name,
            "env_var": sw.env_var,
            "description": sw.description,
            "live": sw.live,
            "effect": sw.effect,
            "enabled": self.enabled,
            "degraded": self.degraded,
            "unavailable": self.unavailable,
            "reason": self.reason,
        }


@dataclass
class SwitchBoard:
    """Thread-safe run-time switch states. The engine thread reads; control routes write."""

    states: dict[str, SwitchState] = field(default_factory=dict)
    # switches whose code path cannot run here at all (e.g. kernels that need CUDA), with why: degraded at once,
    # and turning one on live keeps it degraded with that reason instead of pretending it runs
    unavailable: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_values(cls, values: Mapping[str, bool]) -> "SwitchBoard":
        board = cls()
        for s in SWITCHES:
            board.states[s.name] = SwitchState(s.name, bool(values.get(s.name, s.default)))
        return board

    def enabled(self, name: str) -> bool:
        return self.states[get_switch(name).name].enabled

    def set_live(self, name: str, enabled: bool) -> SwitchState:
        """Toggle a live switch. Raises SwitchNeedsRestart for start-only switches, UnknownSwitch for typos.

        Re-enabling a degraded switch clears the degradation: the person at the terminal asked for it again.
        """
        sw = get_switch(name)
        with self._lock:
            state = self.states[sw.name]
            if state.enabled == enabled:
                return state
            if not sw.live:
                raise SwitchNeedsRestart(sw.name)
            if enabled and sw.name in self.unavailable:
                state.degraded, state.reason = True, self.unavailable[sw.name]
                return state
            state.enabled = enabled
            if enabled:
                state.degraded, state.reason = False, ""
            return state

    def mark_unavailable(self, name: str, reason: str) -> SwitchState:
        """This switch's code path cannot run on this engine: off, degraded with `reason`, and it stays so."""
        sw = get_switch(name)
        self.unavailable[sw.name] = reason
        state = self.degrade(sw.name, reason)
        with self._lock:
            state.unavailable = True
        return state

    def degrade(self, name: str, reason: str, bus: EventBus | None = None, where: str = "engine",
                what: str = "") -> SwitchState:
        """Turn a switch off for the rest of the run because its code path failed; keeps the reason.

        With a bus, the one place that tells about it: a SwitchEvent (degraded) and a WarningEvent
        "switch NAME degraded for the rest of the run[, what]: reason" (the log and the TUI show that line).
        """
        sw = get_switch(name)
        with self._lock:
            state = self.states[sw.name]
            state.enabled, state.degraded, state.reason = False, True, reason
        if bus is not None:
            bus.publish(SwitchEvent(name=sw.name, state="degraded", reason=reason))
            detail = f", {what}" if what else ""
            bus.publish(WarningEvent(where=where, message=(
                f"switch {sw.name} degraded for the rest of the run{detail}: {reason}")))
        return state

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [self.states[s.name].to_json() for s in SWITCHES]

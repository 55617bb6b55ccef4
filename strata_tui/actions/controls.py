"""What the monitor's keys do: switches, the VRAM reserve, the expert-cache budget and load scenarios. A collaborator the app
delegates its actions to; it reads and writes the ViewState and never draws.

A key is acknowledged at once (the note changes before any I/O), then a worker writes the one changed key
to the profile on disk (in a thread: it fsyncs) and applies the change to the running engine through its
control routes, on the run's one HTTP client. Attached to an engine this app did not start, nothing is
written locally: the change goes to that engine only.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from engine.option_checks import VRAM_RESERVE_MAX_MIB
from engine.errors import StrataError
from engine.snapshot import ExpertCacheSnapshot
from engine.switches import SWITCHES, get_switch
from strata_tui.engine_io.telemetry_client import TelemetryClient
from strata_tui.profiles.profile import Profile
from strata_tui.profiles.store import ProfileStore
from strata_tui.state.view_state import ViewState

DEFAULT_SCENARIO = "seed"
SHORT_MAX_TOKENS = 128  # tokens each of the seed's short generations asks for from `l`


class Controls:
    """Switch, reserve and load actions over a ViewState, a ProfileStore and the current engine client."""

    def __init__(self, view: ViewState, store: ProfileStore, client: Callable[[], TelemetryClient | None],
                 run_worker: Callable[..., Any], notify: Callable[..., None], post: Callable[[Any], Any]) -> None:
        self.view = view
        self.store = store
        self._client = client
        self._run_worker = run_worker
        self._notify = notify
        self._post = post
        self._reserve_steps: list[tuple[int, int]] = []  # (signed step MiB, the reserve shown when pressed)
        self._reserve_busy = False

    # --- the profile on disk -------------------------------------------------------------------------

    async def _write(self, write: Callable[[], Profile]) -> Profile | None:
        """Run one store write in a thread; on refusal say why (the file is named) and return None."""
        try:
            profile = await asyncio.to_thread(write)
        except StrataError as exc:
            self._notify(str(exc), title="profile not saved", severity="error", timeout=10)
            return None
        self.view.profile = profile
        self.view.changed()
        return profile

    # --- switches ------------------------------------------------------------------------------------

    def toggle_switch(self, number: int) -> None:
        """Flip switch `number` (1-based, registry order; past the ninth from the palette): acknowledge, save the
        one key, apply it live."""
        if not 1 <= number <= len(SWITCHES):
            return
        switch = SWITCHES[number - 1]
        view = self.view.monitor.switches[switch.name]
        if switch.moe_only and self._dense_engine() and not view.wanted and not view.running:
            # It would change nothing this model does: say so, write nothing (its panel line is not even shown).
            key = str(number) if number <= 9 else "ctrl+p"
            self.view.status_note = (f"{key} {switch.name}: MoE only, and this engine's model is dense (no expert "
                                     f"cache): not changed")
            self._notify(self.view.status_note, severity="warning")
            self.view.changed()
            return
        if self.view.attached:
            # Only against what the engine serving now said: after a reconnect the old one's value is no guide.
            if view.running is None or self.view.resyncing:
                view.note = "not sent: reading the engine's state; press again in a moment"
                self.view.changed()
                return
            wanted = not view.running
        elif self.view.profile is None:
            self._notify("no usable profile: pick or fix one in Profiles (p)", severity="error")
            return
        else:
            wanted = not view.wanted
        view.wanted = wanted
        client = self._client()
        if client is None:
            view.note = "saving: applies at the next start"
        elif view.unavailable:
            view.note = "n/a here: saving to the profile…"
        elif switch.live:
            view.note = "applying live…"
        else:
            view.note = "start only: saving…"
        self.view.changed()
        self._run_worker(self._switch(switch.name, wanted, client, self.view.engine_instance),
                         group=f"switch-{switch.name}", exclusive=True, exit_on_error=False)

    def _dense_engine(self) -> bool:
        """The engine serving now has said what it runs (its state was read) and has no expert cache."""
        engine_said = any(v.running is not None for v in self.view.monitor.switches.values())
        return engine_said and self._client() is not None and self.view.monitor.experts is None

    async def _switch(self, name: str, wanted: bool, client: TelemetryClient | None, instance: str | None) -> None:
        view = self.view.monitor.switches[name]
        if not self.view.attached:
            profile_name = self.view.profile.name
            if await self._write(lambda: self.store.set_switch(profile_name, name, wanted)) is None:
                view.wanted, view.note = not wanted, "not saved"
                self.view.changed()
                return
            if client is None:
                view.note = "saved: applies at the next start"
                self.view.changed()
                return
        if self.view.attached and (self.view.resyncing or self.view.engine_instance != instance):
            view.note = "not sent: another engine answers now; press again"  # the key was about the old one
            self.view.changed()
            return
        if not get_switch(name).live:
            # Nothing to ask the engine: a start-only switch changes at the next start (an answer that the value
            # is unchanged would read as applied live when it is only back to what runs).
            view.note = ("start only: restart that engine to apply" if self.view.attached
                         else "saved for next start")
            self.view.changed()
            return
        result = await client.set_switch(name, wanted)
        answer = result.body.get("switch") if result.ok and isinstance(result.body, dict) else None
        if isinstance(answer, dict) and answer.get("name") == name:
            # What the engine runs now, which is not always what was asked (a switch that cannot run here)
            self.view.monitor.apply_switch_state(answer)
            if view.unavailable:  # this engine cannot run it: say what became of the key press
                view.note = "n/a here: not applied" if self.view.attached else "n/a here: saved, not applied"
            else:
                view.note = "applied live"
        elif result.ok:
            view.running, view.note = wanted, "applied live"
            if wanted:
                view.degraded, view.unavailable, view.reason = False, False, ""
        elif result.status == 409:
            view.note = "restart to apply" if not self.view.attached else "start only: restart that engine"
        else:
            view.note = f"not applied: {result.message}"
            self._notify(f"{name}: {result.message}", severity="error")
        self.view.changed()

    # --- VRAM reserve --------------------------------------------------------------------------------

    def reserve(self, direction: int, large: bool = False) -> None:
        """Raise (+1) or lower (-1) the VRAM reserve by the small or large step; saved and applied live.

        The step goes on top of what the profile says when it is written (read-modify-write under the
        store's lock): a value edited by hand since the app last read it is stepped from, never dropped,
        and the note says so. Steps are applied in order, none dropped, however fast the keys come."""
        if self.view.profile is None and not self.view.attached:
            return
        settings = self.view.settings
        step = settings.reserve_big_step_mib if large else settings.reserve_step_mib
        signed = step if direction > 0 else -step
        current = self.view.monitor.vram_reserve_mib
        if current is None:
            current = self.view.profile.engine.vram_reserve_mib if self.view.profile else 0
        self.view.monitor.vram_reserve_mib = _reserve_clamp(current + signed)
        self.view.reserve_note = ("applying live…" if self._client() is not None
                                  else "saving: applies at the next start")
        self.view.changed()
        self._reserve_steps.append((signed, current))
        if not self._reserve_busy:
            self._reserve_busy = True
            self._run_worker(self._reserve_worker(), group="reserve", exit_on_error=False)

    async def _reserve_worker(self) -> None:
        """Write and apply the queued reserve steps, a batch at a time, until none is left."""
        written: int | None = None  # what this worker wrote last: the file holding anything else is an edit
        try:
            while self._reserve_steps:
                steps, self._reserve_steps = self._reserve_steps, []
                expected = written if written is not None else steps[0][1]
                outcome = await self._reserve_batch([s for s, _ in steps], expected)
                if outcome is None:
                    return
                written = outcome
        finally:
            self._reserve_busy = False
            self._reserve_steps.clear()

    async def _reserve_batch(self, steps: list[int], expected: int) -> int | None:
        """Apply `steps` to the profile's value (the app believed it to be `expected`) and then to the engine;
        the value written, or None when nothing was saved (the note says why)."""
        client = self._client()
        disk = expected
        if self.view.attached:
            mib = _reserve_apply(expected, steps)
        else:
            profile_name, seen = self.view.profile.name, {}

            def change(on_disk: Profile) -> dict[str, dict[str, int]]:
                seen["disk"] = on_disk.engine.vram_reserve_mib
                return {"engine": {"vram_reserve_mib": _reserve_apply(seen["disk"], steps)}}

            saved = await self._write(lambda: self.store.update(profile_name, change))
            if saved is None:
                self.view.monitor.vram_reserve_mib, self.view.reserve_note = expected, "not saved"
                self.view.changed()
                return None
            mib, disk = saved.engine.vram_reserve_mib, seen.get("disk", expected)
        if not self._reserve_steps:
            self.view.monitor.vram_reserve_mib = mib
        edited = ""
        if disk != expected:
            edited = f"the file said {disk} MiB (edited on disk), now {mib} MiB: "
            self._notify(f"{self.store.path(self.view.profile.name)}: vram_reserve_mib was {disk} MiB on disk, "
                         f"not {expected} MiB as shown; the step went on top of the file's value: {mib} MiB",
                         title="profile changed on disk", severity="warning", timeout=10)
        if client is None:
            self.view.reserve_note = edited + "saved: applies at the next start"
            self.view.changed()
            return mib
        result = await client.set_vram_reserve(mib)
        if result.ok:
            self.view.reserve_note = edited + "applied live"
        else:
            self.view.reserve_note = edited + f"not applied: {result.message}"
            self._notify(f"VRAM reserve {mib} MiB: {result.message}", severity="error")
        self.view.changed()
        return mib

    async def _save_for_next_start(self, option: str, value: int, client: TelemetryClient | None, note: str,
                                   saved: str) -> bool:
        """Save `[engine] option = value` to the profile in place (not when attached): True when it should now
        also be applied live; else the view's `note` field says why not (not saved, or no engine to apply to)."""
        if self.view.attached:
            return True
        profile_name = self.view.profile.name
        if await self._write(lambda: self.store.set_engine(profile_name, **{option: value})) is None:
            setattr(self.view, note, "not saved")
        elif client is None:
            setattr(self.view, note, saved)
        else:
            return True
        self.view.changed()
        return False

    # --- expert cache (MoE) ---------------------------------------------------------------------------

    def expert_budget(self, direction: int) -> None:
        """One slot per layer more (+1) or fewer (-1) in the expert cache: applied live (a grow takes only what
        the engine's VRAM books allow) and saved to the profile as `expert_cache_mib` (launched runs only)."""
        experts = self.view.monitor.experts
        if experts is None:
            self._notify("this engine has no expert cache (a dense model)", severity="warning")
            return
        if self.view.profile is None and not self.view.attached:
            return
        from strata_tui.state.expert_view import budget_step_mib

        new_mib = budget_step_mib(experts.snapshot, direction)
        if new_mib is None:
            self.view.expert_note = ("every expert is resident already" if direction > 0
                                     else "one slot per layer is the least")
            self.view.changed()
            return
        client = self._client()
        self.view.expert_note = (f"{new_mib} MiB: applying live…" if client is not None
                                 else f"{new_mib} MiB: saving, applies at the next start")
        self.view.changed()
        self._run_worker(self._expert_budget(new_mib, client), group="experts", exclusive=True,
                         exit_on_error=False)

    async def _expert_budget(self, mib: int, client: TelemetryClient | None) -> None:
        if not await self._save_for_next_start("expert_cache_mib", mib, client, "expert_note",
                                               f"{mib} MiB saved: applies at the next start"):
            return
        result = await client.set_expert_cache_mib(mib)
        if result.ok:
            if isinstance(result.body, dict) and isinstance(result.body.get("experts"), dict):
                self.view.monitor.apply_experts(ExpertCacheSnapshot.from_json(result.body["experts"]))
            experts = self.view.monitor.experts
            short = experts is not None and experts.slots is not None and experts.slots < (experts.target_slots or 0)
            self.view.expert_note = (f"{mib} MiB applied live" + (": growing as VRAM frees" if short else "")
                                     + ("" if self.view.attached else ", saved"))
        else:
            self.view.expert_note = f"not applied: {result.message}"
            self._notify(f"expert cache {mib} MiB: {result.message}", severity="error")
        self.view.changed()

    # --- load ----------------------------------------------------------------------------------------

    def run_load(self, name: str = DEFAULT_SCENARIO, overrides: dict[str, Any] | None = None) -> None:
        """Play a named scenario from engine.loadgen.scenarios against the running engine; one at a time.
        `overrides` replace the scenario parameters the app would choose (load_params)."""
        if self.view.engine_url is None or self.view.monitor.engine_state not in ("ready", "running"):
            self._notify("the engine is not ready: no load sent", severity="warning")
            return
        if self.view.load_running is not None:
            self.view.status_note = (f"load {self.view.load_running} is still running: wait for its result "
                                     f"(nothing new was started)")
            self.view.changed()
            self._notify(self.view.status_note, severity="warning")
            return
        from strata_tui.engine_io.workers import run_load

        api_key = self.view.profile.engine.api_key if self.view.profile else None
        self.view.load_running, self.view.load_progress = name, f"load {name}: starting"
        self.view.changed()
        params = {**self.load_params(name), **(overrides or {})}
        self._run_worker(run_load(self._post, name, self.view.engine_url, api_key, params, self.view.kind),
                         group="load", exit_on_error=False)

    def load_params(self, name: str) -> dict[str, int]:
        """The scenario parameters the app chooses; the long prompt is fitted to the context the server reports
        when the scenario starts (workers.fit_to_server: the seed's 150K needs a context of 150K)."""
        if name not in ("seed", "reuse"):
            return {}
        from engine.loadgen.scenarios import get_scenario

        defaults = {p.name: p.default for p in get_scenario(name).params}
        params: dict[str, int] = {}
        if "short_max_tokens" in defaults:
            # The scenario's default decodes the shorts until the long prompt is done, asking max_tokens = the
            # whole context each (a 16K profile showed an 18-minute ETA on every short row): short means short.
            params["short_max_tokens"] = SHORT_MAX_TOKENS
        return params

    def cancel_load(self, cancel: Callable[[], Any]) -> None:
        """Stop the running scenario (`cancel` cancels its worker: its open requests are closed, so the engine
        aborts them)."""
        name = self.view.load_running
        if name is None:
            self._notify("no load scenario is running", severity="warning")
            return
        cancel()
        self.view.load_running, self.view.load_progress = None, ""
        self.view.status_note = f"load {name} cancelled: its requests were closed"
        self.view.changed()


def _reserve_clamp(mib: int) -> int:
    return max(0, min(VRAM_RESERVE_MAX_MIB, mib))


def _reserve_apply(mib: int, steps: list[int]) -> int:
    """The reserve after `steps` in order, each clamped as a key press is (five -512 from 1152 end at 0)."""
    for step in steps:
        mib = _reserve_clamp(mib + step)
    return mib

"""The app's control actions: switches, VRAM reserve, stop/restart, load, and profile changes.

Each action changes the profile (saved at once), then applies the change to the running engine through
its control routes in a worker, and reports what the engine said. Mixed into StrataApp, which owns the
attributes used here (profile, store, monitor, engine_url, process, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import StrataError
from engine.switches import SWITCHES
from strata_tui.profiles import Profile
from strata_tui.telemetry_client import TelemetryClient

if TYPE_CHECKING:
    from strata_tui.app import StrataApp

    _Base = StrataApp
else:
    _Base = object

DEFAULT_SCENARIO = "seed"


class ControlActions(_Base):
    """Actions bound to keys and palette commands. Requires the StrataApp attributes."""

    def _save_profile(self, profile: Profile) -> bool:
        try:
            self.store.save(profile)
        except StrataError as exc:
            self.notify(str(exc), title="profile not saved", severity="error", timeout=10)
            return False
        self.profile = profile
        return True

    def _client(self) -> TelemetryClient | None:
        if self.engine_url is None or self.monitor.engine_state in ("exited", "stopping"):
            return None
        return TelemetryClient(self.engine_url, api_key=self.profile.engine.api_key if self.profile else None)

    # --- switches ------------------------------------------------------------------------------------

    def action_toggle_switch(self, number: int) -> None:
        """Flip switch `number` (1-based, registry order): save it, then apply it live if the engine can."""
        if self.profile is None or not 1 <= number <= min(9, len(SWITCHES)):
            return
        name = SWITCHES[number - 1].name
        view = self.monitor.switches[name]
        wanted = not view.wanted
        if not self._save_profile(self.profile.with_switch(name, wanted)):
            return
        view.wanted = wanted
        client = self._client()
        if client is None:
            view.note = "saved: applies at the next start"
        else:
            view.note = "applying…"
            self.run_worker(self._apply_switch(client, name, wanted), group=f"switch-{name}", exclusive=True)
        self.changed()

    async def _apply_switch(self, client: TelemetryClient, name: str, enabled: bool) -> None:
        try:
            result = await client.set_switch(name, enabled)
        finally:
            await client.aclose()
        view = self.monitor.switches[name]
        if result.ok:
            view.running, view.note = enabled, "applied live"
            if enabled:
                view.degraded, view.reason = False, ""
        elif result.status == 409:
            view.note = "restart to apply"
        else:
            view.note = f"not applied: {result.message}"
            self.notify(f"{name}: {result.message}", severity="error")
        self.changed()

    # --- VRAM reserve --------------------------------------------------------------------------------

    def action_reserve(self, direction: int, large: bool = False) -> None:
        """Raise (+1) or lower (-1) the VRAM reserve by the small or large step; saved and applied live."""
        if self.profile is None:
            return
        settings = self.profile.tui
        step = settings.reserve_big_step_mib if large else settings.reserve_step_mib
        current = self.monitor.vram_reserve_mib
        if current is None:
            current = self.profile.engine.vram_reserve_mib
        new_mib = max(0, current + (step if direction > 0 else -step))
        if not self._save_profile(self.profile.with_engine(vram_reserve_mib=new_mib)):
            return
        self.monitor.vram_reserve_mib = new_mib
        client = self._client()
        if client is None:
            self.reserve_note = "saved: applies at the next start"
        else:
            self.reserve_note = "applying…"
            self.run_worker(self._apply_reserve(client, new_mib), group="reserve", exclusive=True)
        self.changed()

    async def _apply_reserve(self, client: TelemetryClient, mib: int) -> None:
        try:
            result = await client.set_vram_reserve(mib)
        finally:
            await client.aclose()
        if result.ok:
            self.reserve_note = "applied live"
        else:
            self.reserve_note = f"not applied: {result.message}"
            self.notify(f"VRAM reserve {mib} MiB: {result.message}", severity="error")
        self.changed()

    # --- engine lifecycle ----------------------------------------------------------------------------

    def action_stop_engine(self) -> None:
        if self.attach_url:
            self.notify("attached to an engine this app did not start: stop it where it runs", severity="warning")
            return
        if not self.engine_running:
            self.notify("the engine is not running")
            return
        self.run_worker(self.stop_process(), group="control", exit_on_error=False)

    def action_restart_engine(self) -> None:
        """Stop the engine (if running) and launch it again from the current profile."""
        if self.attach_url:
            self.notify("attached to an engine this app did not start: restart it where it runs",
                        severity="warning")
            return
        self.run_worker(self._restart(), group="control", exclusive=True, exit_on_error=False)

    async def _restart(self) -> None:
        await self.stop_process()
        self.start_engine()

    # --- load ----------------------------------------------------------------------------------------

    def action_run_load(self, name: str = DEFAULT_SCENARIO) -> None:
        """Play a named scenario from engine.loadgen.scenarios against the running engine."""
        if self.engine_url is None or self.monitor.engine_state not in ("ready", "running"):
            self.notify("the engine is not ready: no load sent", severity="warning")
            return
        from strata_tui.workers import run_load

        params = self.load_params(name)
        api_key = self.profile.engine.api_key if self.profile else None
        self.status_note = f"load {name}: starting"
        self.run_worker(run_load(self, name, self.engine_url, api_key, params), group="load", exclusive=True,
                        exit_on_error=False)
        self.changed()

    def load_params(self, name: str) -> dict[str, int]:
        """Fit a scenario's long prompt to this engine's context (the seed's 150K needs --context >= 150K)."""
        if self.profile is None or name not in ("seed", "reuse"):
            return {}
        from engine.loadgen.scenarios import get_scenario

        defaults = {p.name: p.default for p in get_scenario(name).params}
        max_tokens = int(defaults.get("long_max_tokens", defaults.get("max_tokens", 16)))
        room = self.profile.engine.context - max_tokens
        return {"long_tokens": int(min(defaults["long_tokens"], room))}

    # --- profiles ------------------------------------------------------------------------------------

    def use_profile(self, profile: Profile) -> None:
        """Make `profile` the current one (and the last used); relaunch the engine with it."""
        self.store.set_last_used(profile.name)
        self._set_profile(profile)
        self.notify(f"using profile {profile.name}")
        if self.launch:
            self.action_restart_engine()

    def profile_saved(self, profile: Profile) -> None:
        """The editor saved a profile; if it is the current one, take its settings."""
        if self.profile is None or profile.name != self.profile.name:
            return
        self.profile = profile
        for name, view in self.monitor.switches.items():
            view.wanted = bool(profile.engine.switches.get(name, False))
        if self.engine_running:
            self.notify("saved: engine options apply at the next restart (r)")
        self.changed()

    def profile_renamed(self, old: str, new: str) -> None:
        if self.profile is not None and self.profile.name == old:
            self.profile = self.store.load(new)
            self.sub_title = f"profile {new}"
            self.changed()

"""StrataApp's handling of vLLM, SGLang and llama.cpp servers, as a mixin so app.py keeps one branch per
entry point: launch a profile of another kind (argv from strata_tui/profiles/kinds.py, readiness from its health
route), attach with detection or `--kind`, and fold each endpoint's reading into `view.foreign`."""

from __future__ import annotations

import os

from strata_tui.engine_io.foreign import KindsDetected, detect_kinds, empty_view, poll_endpoint, split_urls, wait_ready
from strata_tui.engine_io.launcher import EngineProcess
from strata_tui.engine_io.messages import EngineReady
from strata_tui.engine_io.workers import engine_callbacks, run_engine
from strata_tui.profiles.kinds import KIND_NAMES, SPECS
from strata_tui.profiles.profile import Profile


STRATA_ONLY_ACTIONS = {"toggle_switch", "expert_budget"}  # the monitor screen hides its reserve keys itself


class ForeignEngines:
    """Mixed into StrataApp (which provides view, run_worker, notify, post_message, process, run_id...)."""

    attach_kind: str | None = None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Switches, the VRAM reserve and the seed scenario's keys are Strata's: another engine has none."""
        if action in STRATA_ONLY_ACTIONS and self.view.kind != "strata":
            return False
        return super().check_action(action, parameters)  # type: ignore[misc]

    # --- attach --------------------------------------------------------------------------------------

    def attach_foreign_or_detect(self) -> bool:
        """On mount with --attach: a named non-Strata kind starts its readers now; no kind starts detection (of
        every URL: they may be of different kinds). Returns True when this took the attachment over (the Strata
        path then does nothing)."""
        urls = split_urls(self.view.attach_url or "")
        if self.attach_kind == "strata":
            if len(urls) > 1:
                self._watch_foreign("strata", urls, ["strata"] * len(urls))
            return False
        if self.attach_kind is None:
            self.run_worker(detect_kinds(self.post_message, urls, self.api_key()), group="detect",
                            exit_on_error=False)
            return True
        self._watch_foreign(self.attach_kind, urls)
        return True

    def on_kinds_detected(self, message: KindsDetected) -> None:
        """The first URL's kind decides the panels (Strata's, or the endpoint panel); every URL gets a row of its
        own kind in the endpoint table when there are several."""
        urls = split_urls(self.view.attach_url or "")
        kind = message.kinds[0]
        if kind is None:
            reason = message.reasons[0]
            # the status line already names the URL: the reason alone, so a narrow line keeps it
            self.view.status_note = reason.removeprefix(f"{urls[0]}: ")
            self.view.monitor.engine_state = "not detected"
            self.notify(reason, title="attach", severity="error", timeout=15)
            self.view.changed()
            return
        if kind == "strata":
            self._open_client(urls[0])  # the Strata path: events, liveness, experts
            if len(urls) > 1:
                self._watch_foreign("strata", urls, message.kinds, message.reasons)
        else:
            self._watch_foreign(kind, urls, message.kinds, message.reasons)

    def _watch_foreign(self, kind: str, urls: list[str], kinds: list[str | None] | None = None,
                       reasons: list[str] | None = None) -> None:
        """Read every endpoint on its own loop, each by its kind's adapter. `kind`: the first's, which decides the
        panels (a Strata engine keeps its own; its row sits in the endpoint table beside the others)."""
        kinds = kinds or [kind] * len(urls)
        self.view.kind = kind
        self.view.foreign = empty_view(kind, urls, kinds, reasons)
        if kind != "strata":
            self.view.engine_url = urls[0]  # the load scenario (`l`) speaks OpenAI to the first one
        names = " + ".join(dict.fromkeys(KIND_NAMES[k] for k in kinds if k))
        self.sub_title = f"{names} · " + (f"attached to {', '.join(urls)}" if self.attach_url
                                          else f"profile {self.view.profile_name}")
        self.workers.cancel_group(self, "foreign")
        engine = self.view.profile.foreign if self.view.profile is not None and not self.attach_url else None
        key = (engine.api_key if engine is not None else None) or self.api_key()
        for index, (url, endpoint_kind) in enumerate(zip(urls, kinds)):
            if endpoint_kind is None:
                continue  # not detected: its row says why
            self.run_worker(poll_endpoint(self.post_message, endpoint_kind, index, url, key), group="foreign",
                            exit_on_error=False)
        self.view.changed()

    # --- launch --------------------------------------------------------------------------------------

    def start_foreign(self, profile: Profile) -> None:
        """Launch a vLLM / SGLang / llama.cpp profile, or refuse in one line when its program is missing."""
        engine = profile.foreign
        assert engine is not None
        self._close_client()
        self.workers.cancel_group(self, "foreign")
        self.view.kind, self.view.foreign = engine.kind, None
        self.view.crash, self.view.engine_url, self.view.telemetry_connected = None, None, None
        self.view.unreachable_since = None
        self.view.stderr_tail.clear()
        missing = engine.missing_program(os.environ.get("PATH"))
        if missing:
            self.view.monitor.engine_state = "not started"
            self.view.status_note = missing
            self.view.append_log([("tui", missing)])
            self.notify(missing, title="not launched", severity="error", timeout=15)
            self.view.changed()
            return
        self.view.run += 1
        argv = engine.argv()
        self.process = EngineProcess(argv, engine.child_env(os.environ), cwd=self.engine_cwd,
                                     **engine_callbacks(self.post_message, self.run_id))
        self.view.monitor.reset_for_launch()
        self.view.status_note = ""
        self.sub_title = f"{engine.name} · profile {profile.name}"
        self.view.append_log([("tui", "$ " + " ".join(argv))])
        self.run_worker(run_engine(self.post_message, self.process, self.run_id), group="engine",
                        exclusive=True, exit_on_error=False)
        self.run_worker(wait_ready(self.post_message, self.process, engine.url, SPECS[engine.kind].health_path,
                                   self.run_id, EngineReady), group="foreign", exit_on_error=False)

    def open_foreign(self, url: str) -> None:
        """The launched server answers its health route: read it and the profile's other endpoints."""
        engine = self.view.profile.foreign if self.view.profile is not None else None
        extra = list(engine.endpoints) if engine is not None else []
        self._watch_foreign(self.view.kind, [url, *[u for u in extra if u != url]])

"""StrataApp's handling of vLLM, SGLang and llama.cpp servers, as a mixin so app.py keeps one branch per
entry point: launch a profile of another kind (argv from strata_tui/kinds.py, readiness from its health
route), attach with detection or `--kind`, and fold each endpoint's reading into `view.foreign`."""

from __future__ import annotations

import os

from strata_tui.foreign import (EndpointRead, KindDetected, detect_kind, empty_view, poll_endpoint, split_urls,
                                wait_ready)
from strata_tui.kinds import KIND_NAMES, SPECS
from strata_tui.launcher import EngineProcess
from strata_tui.messages import EngineReady
from strata_tui.profiles import Profile
from strata_tui.workers import engine_callbacks, run_engine


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
        """On mount with --attach: a named non-Strata kind starts its readers now; no kind starts detection.
        Returns True when this took the attachment over (the Strata path then does nothing)."""
        urls = split_urls(self.view.attach_url or "")
        if self.attach_kind == "strata":
            return False
        if self.attach_kind is None:
            self.run_worker(detect_kind(self.post_message, urls[0], self.api_key()), group="detect",
                            exit_on_error=False)
            return True
        self._watch_foreign(self.attach_kind, urls)
        return True

    def on_kind_detected(self, message: KindDetected) -> None:
        urls = split_urls(self.view.attach_url or "")
        if message.kind is None:
            # the status line already names the URL: the reason alone, so a narrow line keeps it
            self.view.status_note = message.reason.removeprefix(f"{urls[0]}: ") if urls else message.reason
            self.view.monitor.engine_state = "not detected"
            self.notify(message.reason, title="attach", severity="error", timeout=15)
            self.view.changed()
        elif message.kind == "strata":
            self._open_client(urls[0])  # the Strata path: events, liveness, experts
        else:
            self._watch_foreign(message.kind, urls)

    def _watch_foreign(self, kind: str, urls: list[str]) -> None:
        self.view.kind = kind
        self.view.foreign = empty_view(kind, urls)
        self.view.engine_url = urls[0]  # the load scenario (`l`) speaks OpenAI to the first one
        self.sub_title = f"{KIND_NAMES[kind]} · " + (f"attached to {', '.join(urls)}" if self.attach_url
                                                      else f"profile {self.view.profile_name}")
        self.workers.cancel_group(self, "foreign")
        engine = self.view.profile.foreign if self.view.profile is not None and not self.attach_url else None
        key = (engine.api_key if engine is not None else None) or self.api_key()
        for index, url in enumerate(urls):
            self.run_worker(poll_endpoint(self.post_message, kind, index, url, key), group="foreign",
                            exit_on_error=False)
        self.view.changed()

    def on_endpoint_read(self, message: EndpointRead) -> None:
        foreign = self.view.foreign
        if foreign is None or message.index >= len(foreign.endpoints) or message.view.kind != foreign.kind:
            return
        foreign.endpoints[message.index] = message.view
        view = self.view
        if message.index == 0:
            if message.view.reachable:
                view.unreachable_since = None
                if view.monitor.engine_state in ("attaching", "starting", "not started"):
                    view.monitor.engine_state = "ready"
            elif view.unreachable_since is None and not (view.crash is not None and not self.attach_url):
                view.unreachable_since = message.view.unreachable_since
        view.changed()

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

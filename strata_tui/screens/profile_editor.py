"""Edit every engine option of a profile, its switches and its refresh interval.

Values are validated by the engine's own rules (`EngineConfig.from_mapping`): what the editor accepts,
`strata-engine serve` accepts. A rejected value is named (parameter, value, reason) and its field marked.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Checkbox, Footer, Header, Input, Label, Select, Static

from engine.config import KV_DTYPES, EngineConfig
from engine.errors import ConfigError, StrataError
from engine.switches import SWITCHES
from strata_tui.profiles import Profile, TuiSettings

# (EngineConfig field, label, widget kind); "optional" text fields mean None when left empty.
FIELDS: tuple[tuple[str, str, str], ...] = (
    ("model", "model (checkpoint dir or builtin:strata-tiny)", "text"),
    ("device", "device (auto, cpu, cuda:N)", "text"),
    ("batch", "batch (concurrent slots)", "text"),
    ("batch_mtp", "batch MTP drafting", "bool"),
    ("mtp_depth", "MTP depth (draft tokens per round)", "text"),
    ("kv", "KV cache dtype", "kv"),
    ("kv_resident", "resident KV window (tokens, empty = all)", "optional"),
    ("context", "context (tokens per slot)", "text"),
    ("vram_reserve_mib", "VRAM reserve (MiB)", "text"),
    ("peer_device", "peer device (cuda:N, empty = none)", "optional"),
    ("host", "host", "text"),
    ("port", "port (0 = any free port)", "text"),
    ("api_key", "API key (empty = none)", "secret"),
)


class ProfileEditor(Screen[Profile | None]):
    """A form over one profile. ctrl+s validates and returns the edited profile; escape discards."""

    BINDINGS = [Binding("ctrl+s", "save", "Save", priority=True), Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    ProfileEditor VerticalScroll { padding: 0 2; }
    ProfileEditor .row { height: auto; }
    ProfileEditor .row Label { width: 46; padding: 0 1 0 0; }
    ProfileEditor .row Input, ProfileEditor .row Select { width: 1fr; }
    ProfileEditor Input.-invalid-value { background: $error 40%; }
    ProfileEditor #error { color: $error; height: auto; padding: 0 2; }
    ProfileEditor .section { text-style: bold; padding: 1 0 0 0; }
    """

    def __init__(self, profile: Profile) -> None:
        super().__init__()
        self.profile = profile

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="error")
        engine = self.profile.engine
        with VerticalScroll():
            yield Label(f"Profile {self.profile.name}: engine options", classes="section")
            for name, label, kind in FIELDS:
                value = getattr(engine, name)
                with Horizontal(classes="row"):
                    yield Label(label)
                    if kind == "bool":
                        yield Checkbox("on", value=bool(value), id=f"f-{name}", compact=True)
                    elif kind == "kv":
                        yield Select([(k, k) for k in KV_DTYPES], value=value, allow_blank=False, id=f"f-{name}",
                                     compact=True)
                    else:
                        yield Input("" if value is None else str(value), id=f"f-{name}",
                                    password=kind == "secret", compact=True)
            yield Label("switches (read at start; live ones can also be toggled on the monitor)", classes="section")
            for sw in SWITCHES:
                yield Checkbox(f"{sw.env_var}: {sw.description}", value=bool(engine.switches.get(sw.name, False)),
                               id=f"s-{sw.name}", compact=True)
            yield Label("app", classes="section")
            with Horizontal(classes="row"):
                yield Label("refresh interval (s)")
                yield Input(str(self.profile.tui.refresh_s), id="t-refresh_s", compact=True)
        yield Footer()

    def form_values(self) -> dict[str, Any]:
        """The engine options as typed (strings for text fields: the config coerces and validates them)."""
        values: dict[str, Any] = {}
        for name, _, kind in FIELDS:
            widget = self.query_one(f"#f-{name}")
            if isinstance(widget, Checkbox):
                values[name] = widget.value
            elif isinstance(widget, Select):
                values[name] = widget.value
            else:
                text = widget.value.strip()
                if kind in ("optional", "secret") and not text:
                    values[name] = None
                else:
                    values[name] = text
        values["switches"] = {sw.name: self.query_one(f"#s-{sw.name}", Checkbox).value for sw in SWITCHES}
        return values

    def build_profile(self) -> Profile:
        """Validate the form into a Profile; raises ConfigError naming the first bad field."""
        keep = {k: v for k, v in self.profile.engine.to_dict(reveal_secrets=True).items() if k not in dict.fromkeys(
            [f[0] for f in FIELDS] + ["switches"])}
        engine = EngineConfig.from_mapping({**keep, **self.form_values()})
        refresh_text = self.query_one("#t-refresh_s", Input).value.strip()
        try:
            refresh_s = float(refresh_text)
        except ValueError:
            raise ConfigError("refresh_s", refresh_text, "expected a number of seconds") from None
        tui = TuiSettings.from_mapping({**_tui_dict(self.profile.tui), "refresh_s": refresh_s})
        return replace(self.profile, engine=engine, tui=tui)

    def action_save(self) -> None:
        for widget in self.query(".-invalid-value"):
            widget.remove_class("-invalid-value")
        try:
            profile = self.build_profile()
        except ConfigError as exc:
            self.query_one("#error", Static).update(f"{exc.param} = {exc.value!r}: {exc.reason}")
            field_id = f"#f-{exc.param}" if exc.param != "refresh_s" else "#t-refresh_s"
            for widget in self.query(field_id):
                widget.add_class("-invalid-value")
                widget.focus()
            return
        except StrataError as exc:
            self.query_one("#error", Static).update(str(exc))
            return
        self.dismiss(profile)

    def action_cancel(self) -> None:
        self.dismiss(None)


def _tui_dict(tui: TuiSettings) -> dict[str, Any]:
    return {"refresh_s": tui.refresh_s, "reserve_step_mib": tui.reserve_step_mib,
            "reserve_big_step_mib": tui.reserve_big_step_mib}

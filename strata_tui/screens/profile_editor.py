"""Edit every engine option of a profile, its switches and every `[tui]` setting.

The form is generated from the dataclasses that define the options (`EngineConfig`, `TuiSettings`): a
field added there appears here, with a widget chosen from its type (a checkbox for bool, a choice for a
field with fixed choices, text otherwise; `| None` fields mean "none" when left empty). Labels come from
a field's `metadata["help"]` when the engine provides one (every `strata-engine serve` option is an
EngineConfig field, `--log-level` included, so every serve option has a field here). Values are validated by
the same rules the engine uses (`EngineConfig.from_mapping`): what the editor accepts, `strata-engine serve`
accepts. A rejected value is named (parameter, value, reason) and its field marked.

Labels are plain text (never markup: `[tui]` must read as written) and wrap whole at any width. The first
field has the focus when the form opens, and focusing a text field never selects its content (one key would
replace the value).
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, fields, replace
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Checkbox, Footer, Header, Input, Label, Select, Static

from engine.config import KV_DTYPES, MODEL_DTYPES, EngineConfig
from engine.errors import ConfigError, StrataError
from engine.switches import SWITCHES
from strata_tui.profiles.profile import Profile, TuiSettings
from strata_tui.screens.dialogs import ConfirmDialog

# Fixed choices of engine options, for fields whose metadata does not carry them (yet).
_CHOICES = {"kv": KV_DTYPES, "dtype": MODEL_DTYPES}
_SECRET = {"api_key"}
_NOT_IN_FORM = {"switches"}  # edited as their own section


@dataclass(frozen=True)
class FormField:
    """One option as the form shows it."""

    section: str  # engine | tui
    name: str
    label: str
    kind: str  # bool | choice | text | optional | secret
    choices: tuple[str, ...] = ()

    @property
    def widget_id(self) -> str:
        return f"{'f' if self.section == 'engine' else 't'}-{self.name}"


def _describe(section: str, f: Field) -> FormField:
    hint = str(f.type)
    default = f.default if f.default is not MISSING else None
    choices = tuple(f.metadata.get("choices") or _CHOICES.get(f.name, ()))
    if hint.startswith("bool"):
        kind = "bool"
    elif choices:
        kind = "choice"
    elif f.name in _SECRET:
        kind = "secret"
    elif "None" in hint:
        kind = "optional"
    else:
        kind = "text"
    help_text = f.metadata.get("help")
    if help_text is None:
        shown_default = "none" if default is None else ("on" if default is True else "off" if default is False
                                                         else default)
        help_text = f"default {shown_default}"
    return FormField(section, f.name, f"{f.name.replace('_', ' ')} ({help_text})", kind, choices)


def form_fields() -> list[FormField]:
    """Every engine option (but switches) and every [tui] setting, in the dataclasses' order."""
    engine = [_describe("engine", f) for f in fields(EngineConfig) if f.name not in _NOT_IN_FORM]
    return engine + [_describe("tui", f) for f in fields(TuiSettings)]


def on_off(value: bool) -> str:
    return "on" if value else "off"


class ProfileEditor(Screen[Profile | None]):
    """A form over one profile. ctrl+s validates and returns the edited profile; escape discards (asking
    first when something was changed)."""

    BINDINGS = [Binding("ctrl+s", "save", "Save", priority=True), Binding("escape", "cancel", "Cancel")]
    AUTO_FOCUS = None  # on_mount focuses the first field: the same one every time
    DEFAULT_CSS = """
    ProfileEditor VerticalScroll { padding: 0 2; }
    ProfileEditor .row { height: auto; }
    ProfileEditor .row Label { width: 45%; max-width: 60; padding: 0 1 0 0; }
    ProfileEditor .row Input, ProfileEditor .row Select { width: 1fr; }
    ProfileEditor .row:focus-within Label { text-style: bold; color: $text-accent; }
    ProfileEditor Input:focus { background: $accent 35%; }
    ProfileEditor Checkbox:focus { background: $accent 35%; }
    ProfileEditor Input.-invalid-value { background: $error 40%; }
    ProfileEditor #error { color: $error; height: auto; padding: 0 2; }
    ProfileEditor .section { text-style: bold; padding: 1 0 0 0; width: 100%; }
    """

    def __init__(self, profile: Profile) -> None:
        super().__init__()
        self.profile = profile
        self.fields = form_fields()
        self._initial: dict[str, Any] | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="error")
        engine, tui = self.profile.engine, self.profile.tui
        with VerticalScroll():
            yield Label(f"Profile {self.profile.name}: engine options ([engine])", classes="section", markup=False)
            for field in self.fields:
                if field.section == "tui" and field is self._first_tui():
                    yield Label("app settings ([tui])", classes="section", markup=False)
                value = getattr(engine if field.section == "engine" else tui, field.name)
                with Horizontal(classes="row"):
                    yield Label(field.label, markup=False)
                    yield self._widget(field, value)
            yield Label("switches ([switches]; read at start, live ones can also be toggled on the monitor)",
                        classes="section", markup=False)
            for sw in SWITCHES:
                on = bool(engine.switches.get(sw.name, sw.default))
                with Horizontal(classes="row"):
                    yield Label(f"{sw.env_var}: {sw.description}", markup=False)
                    yield Checkbox(on_off(on), value=on, id=f"s-{sw.name}", compact=True)
        yield Footer()

    def _first_tui(self) -> FormField | None:
        return next((f for f in self.fields if f.section == "tui"), None)

    @staticmethod
    def _widget(field: FormField, value: Any):
        if field.kind == "bool":
            return Checkbox(on_off(bool(value)), value=bool(value), id=field.widget_id, compact=True)
        if field.kind == "choice":
            return Select([(c, c) for c in field.choices], value=value, allow_blank=False, id=field.widget_id,
                          compact=True)
        return Input("" if value is None else str(value), id=field.widget_id, password=field.kind == "secret",
                     compact=True, select_on_focus=False)

    def on_mount(self) -> None:
        self._initial = self.form_values()
        self.query_one(f"#{self.fields[0].widget_id}").focus()

    def on_checkbox_changed(self, event: Checkbox.Changed) -> None:
        event.checkbox.label = on_off(event.value)  # the glyph alone looks the same on and off

    def form_values(self) -> dict[str, Any]:
        """Every field as typed (strings for text fields: the config coerces and validates them)."""
        values: dict[str, Any] = {}
        for field in self.fields:
            widget = self.query_one(f"#{field.widget_id}")
            if isinstance(widget, (Checkbox, Select)):
                value: Any = widget.value
            else:
                value = widget.value.strip()
                if field.kind in ("optional", "secret") and not value:
                    value = None
            values[f"{field.section}.{field.name}"] = value
        for sw in SWITCHES:
            values[f"switches.{sw.name}"] = self.query_one(f"#s-{sw.name}", Checkbox).value
        return values

    @property
    def dirty(self) -> bool:
        return self._initial is not None and self.form_values() != self._initial

    def build_profile(self) -> Profile:
        """Validate the form into a Profile; raises ConfigError naming the first bad field."""
        values = self.form_values()
        floats = {f.name for f in fields(EngineConfig) if str(f.type).startswith("float")}
        engine_values = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("engine.")}
        for name in floats & set(engine_values):  # the config coerces text to int, not to float
            engine_values[name] = _number(name, engine_values[name])
        engine_values["switches"] = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("switches.")}
        engine = EngineConfig.from_mapping(engine_values)
        tui_values = {}
        for key, value in values.items():
            if key.startswith("tui."):
                tui_values[key[4:]] = _number(key[4:], value)
        tui = TuiSettings.from_mapping(tui_values)
        return replace(self.profile, engine=engine, tui=tui)

    def action_save(self) -> None:
        for widget in self.query(".-invalid-value"):
            widget.remove_class("-invalid-value")
        try:
            profile = self.build_profile()
        except ConfigError as exc:
            self.query_one("#error", Static).update(f"{exc.param} = {exc.value!r}: {exc.reason}")
            for field in self.fields:
                if field.name == exc.param:
                    widget = self.query_one(f"#{field.widget_id}")
                    widget.add_class("-invalid-value")
                    widget.focus()
            return
        except StrataError as exc:
            self.query_one("#error", Static).update(str(exc))
            return
        self.dismiss(profile)

    @work
    async def action_cancel(self) -> None:
        if self.dirty and not await self.app.push_screen_wait(
                ConfirmDialog(f"Discard your unsaved changes to {self.profile.name}?")):
            return
        self.dismiss(None)


def _number(name: str, text: Any) -> Any:
    """[tui] values are numbers; the form holds text."""
    if not isinstance(text, str):
        return text
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(name, text, "expected a number") from None

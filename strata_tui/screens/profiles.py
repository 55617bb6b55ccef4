"""The profiles screen: list every profile (broken ones with path, line and message), create, duplicate,
rename, delete, edit, and use one. The directory is read in a thread: a slow disk or a large file never
freezes the screen."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from engine.errors import StrataError
from engine.switches import SWITCHES
from strata_tui.profiles.profile import Profile, ProfileError
from strata_tui.screens.dialogs import ConfirmDialog, NameDialog
from strata_tui.screens.profile_editor import ProfileEditor

if TYPE_CHECKING:
    from strata_tui.actions.host import StrataHost


# status beside the name: on a narrow terminal the last columns are cut, and "broken" is what must not be
COLUMNS = ("", "name", "status", "model", "device", "batch", "MTP", "KV", "context", "reserve MiB")


def mtp_label(batch_mtp: bool, depth: int) -> str:
    """MTP drafting as the table shows it: "off", or on with its depth."""
    return f"on, depth {depth}" if batch_mtp else "off"


class ProfilesScreen(Screen):
    """Profiles in the config directory. The selected row's details (or its error) show below the table."""

    BINDINGS = [
        Binding("enter", "use", "Use", priority=True),
        Binding("e", "edit", "Edit"),
        Binding("n", "new", "New"),
        Binding("d", "duplicate", "Duplicate"),
        Binding("r", "rename", "Rename"),
        Binding("x,delete", "delete", "Delete"),
        Binding("escape", "back", "Back"),
    ]
    DEFAULT_CSS = """
    ProfilesScreen DataTable { height: 1fr; border: round $primary-darken-2; }
    ProfilesScreen #detail { height: auto; min-height: 4; border: round $primary-darken-2; padding: 0 1; }
    """

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[Profile | ProfileError] = []
        self.reads_done = 0  # directory reads shown so far (tests wait on it)
        self.note: Text | None = None  # the last action's outcome, on the details' border

    @property
    def strata(self) -> "StrataHost":
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical():
            yield DataTable(id="profiles", cursor_type="row", zebra_stripes=True)
            yield Static(id="detail")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.border_title = f"Profiles in {self.strata.store.profiles_dir}"
        self.query_one("#detail", Static).update(Text("reading the profiles…", style="dim"))
        self.reload(select=self.strata.view.profile_name)  # the cursor starts on the profile in use

    def reload(self, select: str | None = None) -> None:
        """Re-read the directory (in a thread) and redraw; keep (or move) the cursor onto `select`."""
        self._read(select or self.selected_name)

    @work(exclusive=True, group="profiles-read", exit_on_error=False)
    async def _read(self, current: str | None) -> None:
        entries = await asyncio.to_thread(self.strata.store.load_all)
        self._show(entries, current)
        self.reads_done += 1

    def _show(self, entries: list[Profile | ProfileError], current: str | None) -> None:
        table = self.query_one(DataTable)
        self.entries = entries
        rows = [(self._name_of(entry), self._cells(entry)) for entry in self.entries]
        # Columns are rebuilt with the rows, each as wide as its widest cell, given explicitly: auto widths
        # measured while a dialog covered the screen (after n, d or r) came out 4 cells wide, and kept columns
        # would clip a longer name than the last render had.
        table.clear(columns=True)
        for index, label in enumerate(COLUMNS):
            width = max([len(label)] + [Text(str(cells[index])).cell_len for _, cells in rows])
            table.add_column(label, width=width)
        for name, cells in rows:
            table.add_row(*cells, key=name)
        if current and current in table.rows:
            table.move_cursor(row=table.get_row_index(current))
        self._show_detail()

    @staticmethod
    def _name_of(entry: Profile | ProfileError) -> str:
        return entry.path.stem if isinstance(entry, ProfileError) else entry.name

    def _cells(self, entry: Profile | ProfileError) -> tuple:
        name = self._name_of(entry)
        mark = "▶" if name == self.strata.view.profile_name else ""
        if isinstance(entry, ProfileError):
            where = f"line {entry.line}" if entry.line else (entry.key or "see below")
            return (mark, name, Text(f"broken: {where}", style="bold red"), "", "", "", "", "", "", "")
        if entry.foreign is not None:  # vLLM / SGLang / llama.cpp: the kind where the device is
            return (mark, name, Text("ok", style="green"), entry.foreign.model, entry.foreign.name,
                    "", "", "", "", "")
        e = entry.engine
        return (mark, name, Text("ok", style="green"), e.model, e.device, str(e.batch),
                mtp_label(e.batch_mtp, e.mtp_depth), e.kv, f"{e.context:,}", str(e.vram_reserve_mib))

    @property
    def selected_name(self) -> str | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        return key.value

    def selected_entry(self) -> Profile | ProfileError | None:
        name = self.selected_name
        for entry in self.entries:
            if (entry.path.stem if isinstance(entry, ProfileError) else entry.name) == name:
                return entry
        return None

    def on_data_table_row_highlighted(self, _event: DataTable.RowHighlighted) -> None:
        self._show_detail()

    def _show_detail(self) -> None:
        entry = self.selected_entry()
        if entry is None:
            body = Text("no profiles yet: n creates one", style="dim")
        elif isinstance(entry, ProfileError):
            where = f"{entry.path}" + (f", line {entry.line}" if entry.line else "")
            body = Text.assemble(("broken profile (left untouched): ", "bold red"), where, "\n",
                                 (f"{entry.key}: " if entry.key else "", "bold"), entry.message)
        elif entry.foreign is not None:
            body = Text.assemble((f"{self.strata.store.path(entry.name)}\n", "dim"),
                                 f"$ {' '.join(entry.foreign.argv())}\n",
                                 ("env: ", "dim"), ", ".join(entry.foreign.env) or "none")
        else:
            e = entry.engine
            # What the engine will run: the profile's keys over each switch's default (defaults count too)
            on = [sw.name + ("" if sw.name in e.switches else " (default)") for sw in SWITCHES
                  if e.switches.get(sw.name, sw.default)]
            body = Text.assemble(
                (f"{self.strata.store.path(entry.name)}\n", "dim"),
                f"serve {' '.join(e.to_argv())}\n",
                ("switches on: ", "dim"), ", ".join(on) or "none",
                ("   refresh ", "dim"), f"{entry.tui.refresh_s:g} s")
        self.query_one("#detail", Static).update(Text.assemble(self.note, "\n", body) if self.note else body)

    def _fail(self, exc: StrataError) -> None:
        self._say(Text(str(exc), style="bold red"))

    def _say(self, note: Text) -> None:
        """A note above the selected profile's details: a toast here covered half the table."""
        self.note = note
        self._show_detail()

    def action_back(self) -> None:
        self.dismiss()

    def action_use(self) -> None:
        entry = self.selected_entry()
        if isinstance(entry, ProfileError):
            self._fail(entry)
        elif entry is not None:
            self.strata.use_profile(entry)
            self.reload()

    @work
    async def action_edit(self) -> None:
        entry = self.selected_entry()
        if isinstance(entry, ProfileError):
            self._fail(entry)
            return
        if entry is None:
            return
        if entry.foreign is not None:  # the editor is generated from Strata's options
            self.notify(f"kind {entry.foreign.kind}: edit its file by hand: {self.strata.store.path(entry.name)}",
                        severity="warning", timeout=10)
            return
        edited = await self.app.push_screen_wait(ProfileEditor(entry))
        if edited is None:
            return
        try:  # only the keys the editor changed, on top of the file as it is now; fsync off the loop
            saved = await asyncio.to_thread(self.strata.store.apply_edits, entry, edited)
        except StrataError as exc:
            self._fail(exc)
            return
        self.strata.profile_saved(saved)
        self._say(Text(f"saved {saved.name}", style="green"))
        self.reload(select=saved.name)

    # The dialogs run the store operation themselves: a refused name keeps the dialog open with the reason.
    @work
    async def action_new(self) -> None:
        name = await self.app.push_screen_wait(NameDialog("Name of the new profile", submit=self.strata.store.create))
        if name:
            self.reload(select=name)

    @work
    async def action_duplicate(self) -> None:
        source = self.selected_name
        if source is None:
            return
        name = await self.app.push_screen_wait(NameDialog(
            f"Duplicate {source} as", f"{source}-copy", submit=lambda new: self.strata.store.duplicate(source, new)))
        if name:
            self.reload(select=name)

    @work
    async def action_rename(self) -> None:
        old = self.selected_name
        if old is None:
            return
        name = await self.app.push_screen_wait(NameDialog(
            f"Rename {old} to", old, submit=lambda new: new == old or self.strata.store.rename(old, new)))
        if name and name != old:
            self.strata.profile_renamed(old, name)
        if name:
            self.reload(select=name)

    @work
    async def action_delete(self) -> None:
        name = self.selected_name
        if name is None:
            return
        if name == self.strata.view.profile_name and self.strata.engine_running:
            self._say(Text(f"{name} is in use by the running engine: stop it (s) first", style="yellow"))
            return
        if await self.app.push_screen_wait(ConfirmDialog(f"Delete profile {name}?")):
            self._try(lambda: self.strata.store.delete(name))

    def _try(self, operation, select: str | None = None) -> bool:
        try:
            operation()
        except StrataError as exc:
            self._fail(exc)
            return False
        self.reload(select=select)
        return True

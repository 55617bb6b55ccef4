"""The profiles screen: list every profile (broken ones with path, line and message), create, duplicate,
rename, delete, edit, and use one."""

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
from strata_tui.profiles import Profile, ProfileError
from strata_tui.screens.dialogs import ConfirmDialog, NameDialog
from strata_tui.screens.profile_editor import ProfileEditor

if TYPE_CHECKING:
    from strata_tui.host import StrataHost


COLUMNS = ("", "name", "model", "device", "batch", "MTP", "KV", "context", "reserve MiB", "status")


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
        self.reload()

    def reload(self, select: str | None = None) -> None:
        """Re-read the directory and redraw; keep (or move) the cursor onto `select`."""
        table = self.query_one(DataTable)
        current = select or self.selected_name
        # Columns are rebuilt with the rows: auto widths are measured when a column is added, so kept
        # columns would clip a longer name than the last render had ("long-ct" for "long-ctx-big").
        table.clear(columns=True)
        table.add_columns(*COLUMNS)
        self.entries = self.strata.store.load_all()
        for entry in self.entries:
            name = entry.path.stem if isinstance(entry, ProfileError) else entry.name
            mark = "▶" if name == self.strata.view.profile_name else ""
            if isinstance(entry, ProfileError):
                status = Text(f"broken: line {entry.line or '?'}", style="bold red")
                table.add_row(mark, name, "", "", "", "", "", "", "", status, key=name)
            elif entry.foreign is not None:  # vLLM / SGLang / llama.cpp: the kind where the device is
                table.add_row(mark, name, entry.foreign.model, entry.foreign.name, "", "", "", "", "",
                              Text("ok", style="green"), key=name)
            else:
                e = entry.engine
                mtp = mtp_label(e.batch_mtp, e.mtp_depth)
                table.add_row(mark, name, e.model, e.device, str(e.batch), mtp, e.kv, f"{e.context:,}",
                              str(e.vram_reserve_mib), Text("ok", style="green"), key=name)
        if current and current in table.rows:
            table.move_cursor(row=table.get_row_index(current))
        self._show_detail()

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
        detail = self.query_one("#detail", Static)
        if entry is None:
            detail.update(Text("no profiles yet: n creates one", style="dim"))
        elif isinstance(entry, ProfileError):
            where = f"{entry.path}" + (f", line {entry.line}" if entry.line else "")
            detail.update(Text.assemble(("broken profile (left untouched): ", "bold red"), where, "\n",
                                        (f"{entry.key}: " if entry.key else "", "bold"), entry.message))
        elif entry.foreign is not None:
            detail.update(Text.assemble((f"{self.strata.store.path(entry.name)}\n", "dim"),
                                        f"$ {' '.join(entry.foreign.argv())}\n",
                                        ("env: ", "dim"), ", ".join(entry.foreign.env) or "none"))
        else:
            e = entry.engine
            on = [n for n, v in sorted(e.switches.items()) if v]
            detail.update(Text.assemble(
                (f"{self.strata.store.path(entry.name)}\n", "dim"),
                f"serve {' '.join(e.to_argv())}\n",
                ("switches on: ", "dim"), ", ".join(on) or "none",
                ("   refresh ", "dim"), f"{entry.tui.refresh_s:g} s"))

    def _fail(self, exc: StrataError) -> None:
        self.notify(str(exc), severity="error", timeout=8)

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
        self.notify(f"saved {saved.name}")
        self.reload(select=saved.name)

    @work
    async def action_new(self) -> None:
        name = await self.app.push_screen_wait(NameDialog("Name of the new profile"))
        if name:
            self._try(lambda: self.strata.store.create(name), select=name)

    @work
    async def action_duplicate(self) -> None:
        source = self.selected_name
        if source is None:
            return
        name = await self.app.push_screen_wait(NameDialog(f"Duplicate {source} as", f"{source}-copy"))
        if name:
            self._try(lambda: self.strata.store.duplicate(source, name), select=name)

    @work
    async def action_rename(self) -> None:
        old = self.selected_name
        if old is None:
            return
        name = await self.app.push_screen_wait(NameDialog(f"Rename {old} to", old))
        if name and name != old:
            if self._try(lambda: self.strata.store.rename(old, name), select=name):
                self.strata.profile_renamed(old, name)

    @work
    async def action_delete(self) -> None:
        name = self.selected_name
        if name is None:
            return
        if name == self.strata.view.profile_name and self.strata.engine_running:
            self.notify(f"{name} is in use by the running engine: stop it (s) first", severity="warning")
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

"""What each cell of the slots table says: the columns for a width, the progress cell (prefill progress and its
ETA, decode progress, where the KV lies), time to first token, the admission line, the busiest slots when they
outnumber the rows, and the panel's title (the KV block pool). Pure text, no widget: strata_tui/widgets/
slots_table.py draws it."""

from __future__ import annotations

from collections import Counter

from rich.text import Text

from engine.snapshot import KvPagingSnapshot
from engine.telemetry import AdmissionEvent, SlotEvent
from strata_tui.state.prefill_eta import PrefillTrack
from strata_tui.widgets.format import bar

WIDE_AT = 140  # table width from which every column fits
MAX_SLOT_ROWS = 24  # rows of slots at most; past it the busiest, and a row counting the rest
REST_KEY = "rest"  # the row key of that count
_STATE_STYLE = {"prefill": "yellow", "decode": "green", "idle": "dim", "finished": "blue",
                "aborted": "magenta", "error": "bold red"}


NARROW_BELOW = 94  # table width under which the request, prompt and cached columns go (80x24)


def columns_for(width: int) -> tuple[tuple[str, str, int], ...]:
    """(label, key, width) for a table `width` cells wide (each column adds 2 cells of padding). Narrow (80
    columns): slot, state, progress, tok/s and MTP only; the title says where the rest went (the admission line
    under the table names the last request, its prompt and what was cached)."""
    if width < NARROW_BELOW:
        fixed = (("slot", "slot", 4), ("state", "state", 7), ("tok/s", "tok_s", 7), ("MTP", "acceptance", 4))
        progress = max(16, width - 4 - sum(w + 2 for _, _, w in fixed) - 2)
        return fixed[:2] + (("progress", "progress", progress),) + fixed[2:]
    if width < WIDE_AT:
        fixed = (("slot", "slot", 4), ("state", "state", 7), ("request", "request", 10), ("prompt", "prompt", 9),
                 ("cached", "cached", 8), ("tok/s", "tok_s", 7), ("MTP", "acceptance", 4))
        progress = max(22, width - 4 - sum(w + 2 for _, _, w in fixed) - 2)
        return fixed[:5] + (("progress", "progress", progress),) + fixed[5:]
    fixed = (("slot", "slot", 4), ("state", "state", 8), ("prompt", "prompt", 9), ("cached", "cached", 9),
             ("gen", "generated", 8), ("tok/s", "tok_s", 8), ("MTP acc", "acceptance", 7),
             ("first token", "first_token", 26))
    room = width - 4 - sum(w + 2 for _, _, w in fixed) - 4
    request = min(36, max(20, room // 3))
    progress = min(60, max(30, room - request))
    return (fixed[:2] + (("request", "request", request),) + fixed[2:4] + (("progress", "progress", progress),)
            + fixed[4:])


def format_eta(eta_s: float | None) -> str:
    if eta_s is None:
        return ""
    if eta_s >= 60:
        return f"{int(eta_s // 60)}m{int(eta_s % 60):02d}s"
    if eta_s < 0.95:  # under a second in milliseconds: a one-chunk prompt's 46 ms is not "0.0s"
        return f"{eta_s * 1000:.0f}ms"
    return f"{eta_s:.0f}s" if eta_s >= 10 else f"{eta_s:.1f}s"


def format_rate(tok_s: float | None) -> str:
    if not tok_s:
        return ""
    return f"{tok_s / 1000:.1f}k tok/s" if tok_s >= 10000 else f"{tok_s:,.0f} tok/s"


def first_token_text(track: PrefillTrack | None) -> str:
    """"TTFT 41.2s @ 3,640 tok/s" once the first token came, else ""."""
    if track is None or track.ttft_s is None:
        return ""
    rate = format_rate(track.prompt_tok_s)
    return f"TTFT {format_eta(track.ttft_s)}" + (f" @ {rate}" if rate else "")


def admission_line(event: AdmissionEvent | None, track: PrefillTrack | None = None) -> str:
    """The latest admission, the moment the seed report is about: fresh or reused, and, once its first
    token came, how long that took and at what prompt rate."""
    if event is None:
        return ""
    cached = f", {event.cached_tokens:,} cached" if event.cached_tokens else ""
    first = first_token_text(track)
    return (f"last admission: {event.request_id[:20]} → slot {event.slot}, {event.reuse}, "
            f"{event.prompt_tokens:,} prompt tokens{cached}" + (f" · {first}" if first else ""))


def _tokens_short(n: int) -> str:
    return f"{n / 1000:.1f}K" if n >= 1000 else str(n)


def kv_place_text(slot: SlotEvent, wide: bool) -> str:
    """--kv-resident: where the slot's KV lies, once some of it is on the host ("" while all is in VRAM)."""
    if not slot.kv_host_tokens:
        return ""
    host = f"{_tokens_short(slot.kv_host_tokens)} host"
    if not wide:
        return f" {host}"
    return f" · {_tokens_short(slot.kv_resident_tokens + slot.kv_pooled_tokens)} VRAM {host}"


def progress_cell(slot: SlotEvent, track: PrefillTrack | None, now_s: float, width: int, wide: bool) -> Text:
    if slot.state == "prefill" and slot.prompt_tokens:
        to_do = max(0, slot.prompt_tokens - slot.cached_tokens)
        fraction = (min(1.0, max(0.0, (slot.prefilled_tokens - slot.cached_tokens) / to_do)) if to_do else 1.0)
        eta = track.eta_s(now_s) if track is not None else slot.eta_s
        tail = f" {fraction * 100:3.0f}%" + (f" ETA {format_eta(eta)}" if eta is not None else "")
        place = kv_place_text(slot, wide)
        text = bar(fraction, max(4, min(20, width - len(tail) - len(place))), "yellow")
        text.append(tail[:4], style="")
        text.append(tail[4:], style="yellow")
        text.append(place, style="magenta")
        return text
    if slot.state == "decode" and slot.max_tokens:
        counts = f" {slot.generated_tokens:,}/{slot.max_tokens:,}"
        ttft = "" if wide else first_token_text(track).split(" @ ")[0]
        place = kv_place_text(slot, wide)
        tail = counts + (f" {ttft}" if ttft and not place else "")  # where the KV lies says more than TTFT
        width_left = width - len(tail) - len(place)
        text = bar(slot.generated_tokens / slot.max_tokens, min(20, width_left), "green") if width_left >= 4 else Text()
        text.append(tail)
        text.append(place, style="magenta")
        return text
    return Text("")


def slot_cells(slot: SlotEvent, track: PrefillTrack | None = None, now_s: float = 0.0,
               columns: tuple[tuple[str, str, int], ...] | None = None) -> dict[str, Text | str]:
    """The cells of one slot's row, keyed by column key. Equal inputs give equal cells (for diffing)."""
    columns = columns or columns_for(200)
    widths = {key: width for _, key, width in columns}
    prefilling = slot.state == "prefill"
    rate = slot.prefill_tok_s if prefilling else slot.decode_tok_s
    wide = "first_token" in widths
    cells: dict[str, Text | str] = {
        "slot": str(slot.slot),
        "state": Text(slot.state, style=_STATE_STYLE.get(slot.state, "")),
        "request": (slot.request_id or "")[:widths.get("request", 20)],
        "prompt": f"{slot.prompt_tokens:,}" if slot.request_id else "",
        "cached": f"{slot.cached_tokens:,}" if slot.request_id else "",
        "progress": progress_cell(slot, track, now_s, widths.get("progress", 30), wide),
        "generated": f"{slot.generated_tokens:,}" if slot.request_id else "",
        "tok_s": (f"{rate:,.0f}" if rate >= 1000 else f"{rate:.1f}") if rate else "",
        "acceptance": f"{slot.acceptance * 100:.0f}%" if slot.acceptance is not None else "",
        "first_token": first_token_text(track) if slot.request_id else "",
    }
    return {key: cells[key] for key in widths}


def busiest(slots: dict[int, SlotEvent], limit: int = MAX_SLOT_ROWS) -> tuple[list[int], Counter[str]]:
    """The slot numbers to show (all of them when they fit `limit` rows, else the busiest `limit - 1`, by slot
    number) and, by state, the count of those left out."""
    if len(slots) <= limit:
        return sorted(slots), Counter()

    def rank(n: int) -> tuple:
        slot = slots[n]
        order = {"prefill": 0, "decode": 1}.get(slot.state, 2 if slot.request_id else 3)
        rate = slot.prefill_tok_s if slot.state == "prefill" else slot.decode_tok_s
        return order, -(rate or 0.0), n

    shown = sorted(sorted(slots, key=rank)[:limit - 1])
    left = Counter(slots[n].state for n in slots if n not in set(shown))
    return shown, left


def rest_cells(left: Counter[str], columns: tuple[tuple[str, str, int], ...]) -> dict[str, Text | str]:
    """The row counting the slots the table leaves out ("+232 more: 200 decode, 32 idle")."""
    total = sum(left.values())
    parts = ", ".join(f"{n} {state}" for state, n in sorted(left.items(), key=lambda kv: (-kv[1], kv[0])))
    cells: dict[str, Text | str] = {key: "" for _, key, _ in columns}
    cells["state"] = Text(f"+{total}", style="dim")
    width = dict((k, w) for _, k, w in columns)["progress"]  # the widest column in either layout
    cells["progress"] = Text(f"more: {parts}"[:width], style="dim")
    return cells


def slots_title(pool: KvPagingSnapshot | None, admission_wait: str = "", idle: bool = False) -> str:
    """The slots panel's title: with KV by use, what the block pool holds (blocks slots use as their own, free,
    backing the prefix tier and mapped into slots from it, on the host), how many times a slot was preempted, how
    many decoding requests wait for blocks, and that the queue waits for blocks while a slot is free.

    `idle`: every slot is idle. A finished request's blocks go back to the pool when the engine's next step starts
    (what that step may still copy from them stays valid until then), so an engine with nothing to do still
    counts its last requests' blocks as held: they are shown as such, not as in use."""
    if pool is None or not pool.pool_blocks:
        return "Slots"
    used = pool.pool_blocks - pool.free_pool_blocks
    held = f"{pool.used_blocks:,} used"
    if idle and pool.used_blocks:
        used -= pool.used_blocks
        held = f"0 used ({pool.used_blocks:,} of finished requests, free at the next step)"
    parts = [f"KV pool {used * 100 // pool.pool_blocks} % of {pool.pool_blocks:,} blocks: {held}, "
             f"{pool.free_pool_blocks:,} free"]
    if pool.tier_blocks or pool.borrowed_blocks:
        parts.append(f"tier {pool.tier_blocks:,} ({pool.borrowed_blocks:,} shared)")
    if pool.host_blocks:
        parts.append(f"{pool.host_blocks:,} on host")
    text = "Slots · " + ", ".join(parts)
    text += f" · {pool.preemptions:,} preempted" if pool.preemptions else ""
    # decoding requests the last step left out: theirs and the others' KV exceed the pool (the oldest decode)
    text += f" · {pool.paused_requests:,} paused for blocks" if pool.paused_requests else ""
    return text + (" · queue waits for blocks" if admission_wait else "")

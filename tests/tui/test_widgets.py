"""What the widgets draw from given values (no app): progress and ETA, VRAM bars, switch lines."""

from __future__ import annotations

from engine.telemetry import AdmissionEvent, SlotEvent, TierEvent, VramEvent
from strata_tui.state.monitor_state import SwitchView
from strata_tui.widgets.crash_panel import event_line
from strata_tui.widgets.gpu_panel import breakdown_bar, breakdown_text, tier_line
from strata_tui.widgets.slot_cells import admission_line, columns_for, format_eta, slot_cells
from strata_tui.widgets.switches_panel import switch_line


def test_prefill_progress_counts_only_the_tokens_to_prefill_and_shows_eta() -> None:
    # the engine's prefilled_tokens is every prompt token with KV (cached ones included)
    cells = slot_cells(SlotEvent(slot=1, state="prefill", request_id="r", prompt_tokens=1000, cached_tokens=250,
                                 prefilled_tokens=625, prefill_tok_s=500.0, eta_s=1.0))
    assert " 50%" in cells["progress"].plain and "ETA 1.0s" in cells["progress"].plain
    assert cells["tok_s"] == "500.0" and cells["cached"] == "250"


def test_a_reused_prompt_never_shows_more_than_100_percent() -> None:
    cells = slot_cells(SlotEvent(slot=1, state="prefill", request_id="r", prompt_tokens=1000, cached_tokens=980,
                                 prefilled_tokens=1000))
    assert "100%" in cells["progress"].plain and "198%" not in cells["progress"].plain
    start = slot_cells(SlotEvent(slot=1, state="prefill", request_id="r", prompt_tokens=1000, cached_tokens=980,
                                 prefilled_tokens=980))
    assert "  0%" in start["progress"].plain


def test_decode_row_shows_rate_and_acceptance_and_idle_row_is_blank() -> None:
    cells = slot_cells(SlotEvent(slot=0, state="decode", request_id="r", generated_tokens=30, max_tokens=120,
                                 decode_tok_s=31.25, acceptance=0.714))
    assert "30/120" in cells["progress"].plain and "%" not in cells["progress"].plain
    assert cells["tok_s"] == "31.2" and cells["acceptance"] == "71%"
    idle = slot_cells(SlotEvent(slot=0, state="idle"))
    assert idle["progress"].plain == "" and idle["prompt"] == "" and idle["acceptance"] == ""


def test_format_eta() -> None:
    assert format_eta(None) == "" and format_eta(3.25) == "3.2s" and format_eta(42) == "42s"
    assert format_eta(125) == "2m05s"


def test_breakdown_bar_is_proportional_and_exact_width() -> None:
    vram = VramEvent(device="cuda:0", total_mib=1000, weights_mib=500, kv_mib=250, reserve_mib=0, free_mib=250)
    bar = breakdown_bar(vram, 20)
    assert len(bar.plain) == 20 and bar.plain.count("█") == 15


def test_switch_lines_say_degraded_restart_or_live() -> None:
    degraded = SwitchView("SPLIT_ATTN", live=True, wanted=True, running=False, degraded=True, reason="oom at 150K")
    assert "degraded: oom at 150K" in switch_line("1", degraded).plain
    pending = SwitchView("COMPILE", live=False, wanted=True, running=False)
    assert "restart to apply" in switch_line("5", pending).plain
    live = SwitchView("SPLIT_ATTN", live=True, wanted=True, running=True)
    assert switch_line("1", live).plain.rstrip().endswith("live")
    # cannot run here: said as n/a, dimmed, not as a failure in red
    na = SwitchView("PAGED_ATTN", live=True, wanted=True, running=False, degraded=True, unavailable=True,
                    reason="needs a CUDA device with Triton (this engine runs on cpu)")
    line = switch_line("6", na)
    assert "n/a: needs a CUDA device" in line.plain and "degraded" not in line.plain
    assert not any("red" in str(span.style) for span in line.spans), line.spans


def test_the_tier_line_says_by_how_much_and_the_budget_after() -> None:
    grow = tier_line(TierEvent(action="grow", mib=512, total_mib=512, reason="start")).plain
    assert "grow +512 MiB → budget 512 MiB" in grow and grow.rstrip().endswith("start")
    assert "shrink -256 MiB → budget 256 MiB" in tier_line(TierEvent(action="shrink", mib=256, total_mib=256)).plain
    assert "shrink -256 MiB" in tier_line(TierEvent(action="shrink", mib=-256, total_mib=256)).plain  # not "--"


def test_admission_and_event_lines() -> None:
    line = admission_line(AdmissionEvent(request_id="cmpl-long", slot=6, reuse="fresh", prompt_tokens=150000))
    assert "slot 6" in line and "fresh" in line and "150,000" in line
    assert admission_line(None) == ""
    assert event_line(SlotEvent(slot=2, state="decode", seq=9)).startswith("#9 slot: slot=2, state=decode")
    assert event_line(SlotEvent(slot=0, state="decode", seq=9)).startswith("#9 slot: slot=0, state=decode")


def test_a_slot_with_kv_on_the_host_says_how_much_is_in_vram_and_how_much_on_the_host() -> None:
    """--kv-resident: a slot row shows where its context's KV lies (none of it said without spill)."""
    spilled = SlotEvent(slot=2, state="decode", request_id="r", prompt_tokens=60000, prefilled_tokens=60000,
                        generated_tokens=10, max_tokens=100, decode_tok_s=50.0, kv_resident_tokens=16384,
                        kv_pooled_tokens=20000, kv_host_tokens=23626)
    for width in (100, 200):
        cells = slot_cells(spilled, columns=columns_for(width))
        assert "23.6K host" in cells["progress"].plain, (width, cells["progress"].plain)
    assert "36.4K VRAM" in slot_cells(spilled, columns=columns_for(200))["progress"].plain
    resident = SlotEvent(slot=2, state="decode", request_id="r", prompt_tokens=100, prefilled_tokens=100,
                         generated_tokens=10, max_tokens=100, kv_resident_tokens=110)
    assert "host" not in slot_cells(resident, columns=columns_for(200))["progress"].plain


def test_the_books_gain_host_kv_when_some_kv_lies_on_the_host() -> None:
    books = dict(device="cuda:0", total_mib=1000.0, weights_mib=100.0, kv_mib=200.0, graphs_mib=50.0,
                 tier_mib=500.0, reserve_mib=64.0, free_mib=86.0)
    assert "host KV" not in breakdown_text(VramEvent(**books)).plain
    text = breakdown_text(VramEvent(**books, host_kv_mib=3072.0)).plain
    assert "host KV 3072 MiB" in text or "host KV 3,072 MiB" in text, text


def test_the_books_name_a_quantized_weight_format_and_only_that() -> None:
    books = dict(device="cuda:0", total_mib=1000.0, weights_mib=100.0, kv_mib=200.0, graphs_mib=50.0,
                 tier_mib=500.0, reserve_mib=64.0, free_mib=86.0)
    assert "(" not in breakdown_text(VramEvent(**books, weight_format="bf16")).plain
    text = breakdown_text(VramEvent(**books, weight_format="int4 (awq, group 128)")).plain
    assert "weights 100 MiB  (int4)" in text, text
    assert "(gguf)" in breakdown_text(VramEvent(**books, weight_format="gguf Q4_K + Q6_K"), compact=True).plain

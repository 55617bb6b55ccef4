"""The switch registry and the run-time switch board."""

from __future__ import annotations

import re

import pytest

from engine.errors import ConfigError, SwitchNeedsRestart, UnknownSwitch
from engine.switches import SWITCHES, SwitchBoard, get_switch, switches_from_env


def test_registry_has_split_attn_and_five_switches_with_descriptions() -> None:
    names = [s.name for s in SWITCHES]
    assert "SPLIT_ATTN" in names and len(names) >= 5 and len(set(names)) == len(names)
    assert all(s.description and s.env_var == "STRATA_" + s.name for s in SWITCHES)


def test_each_effect_says_why_not_when_or_on_which_machine() -> None:
    """`effect` travels to the TUI over /strata/state: it is the switch's reason, the figures stay in
    docs/SWITCHES.md with their machine and command."""
    for switch in SWITCHES:
        assert switch.effect, switch.name
        assert not re.search(r"\bH[12]00\b|20\d\d-\d\d-\d\d|session|\bcall \d", switch.effect), (switch.name, switch.effect)


def test_env_parsing_accepts_common_spellings_and_names_bad_values() -> None:
    values = switches_from_env({"STRATA_SPLIT_ATTN": "1", "STRATA_COMPILE": "off", "OTHER": "x"})
    assert values["SPLIT_ATTN"] is True and values["COMPILE"] is False
    with pytest.raises(ConfigError) as info:
        switches_from_env({"STRATA_SPLIT_ATTN": "maybe"})
    assert info.value.param == "STRATA_SPLIT_ATTN" and "maybe" in str(info.value)


def test_lookup_by_name_or_env_var_and_unknown_names() -> None:
    assert get_switch("strata_split_attn").name == "SPLIT_ATTN"
    with pytest.raises(UnknownSwitch, match="known switches"):
        get_switch("NOPE")


def test_live_toggle_restart_only_and_degrade() -> None:
    board = SwitchBoard.from_values({"SPLIT_ATTN": True, "FUSED_PROJ": False})
    assert board.enabled("SPLIT_ATTN")
    state = board.degrade("SPLIT_ATTN", "CUDA error: out of memory")
    assert (state.enabled, state.degraded, state.reason) == (False, True, "CUDA error: out of memory")
    state = board.set_live("SPLIT_ATTN", True)  # asking again clears the degradation
    assert state.enabled and not state.degraded
    with pytest.raises(SwitchNeedsRestart, match="restart"):
        board.set_live("FUSED_PROJ", True)
    assert board.set_live("FUSED_PROJ", False).enabled is False  # no change asked: no error
    snap = {s["name"]: s for s in board.snapshot()}
    assert snap["FUSED_PROJ"]["live"] is False and snap["SPLIT_ATTN"]["enabled"] is True


@pytest.mark.parametrize("name", ["PAGED_ATTN", "PAGED_PREFILL", "SHARED_PREFIX"])
def test_a_measured_winner_is_on_by_default_and_its_variable_turns_it_off(name) -> None:
    assert get_switch(name).default is True
    assert switches_from_env({}) == {}  # nothing asked for: every switch takes its default on the board
    board = SwitchBoard.from_values(switches_from_env({}))
    assert board.enabled(name) and not board.enabled("SPLIT_ATTN")
    assert switches_from_env({f"STRATA_{name}": "0"}) == {name: False}
    assert not SwitchBoard.from_values(switches_from_env({f"STRATA_{name}": "0"})).enabled(name)

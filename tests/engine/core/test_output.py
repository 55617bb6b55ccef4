"""Output processing without an engine: detokenized increments, stop strings cut, finish reasons (pure Python)."""

from __future__ import annotations

from engine.api import SamplingParams
from engine.core.output import OutputProcessor, find_stop
from engine.core.request import Request

EOS = 1000


class CharDecoder:
    """Token id n is the character chr(n): the real tokenizer's incremental-decoder interface, no model."""

    def push(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def flush(self) -> str:
        return ""


def _run(params: SamplingParams, steps: list[list[int]]) -> tuple[list, object]:
    """Each step's tokens as the engine hands them over: kept by the request (Scheduler.update), then delivered."""
    proc = OutputProcessor()
    req = Request("r", [1, 2, 3], params)
    track = proc.add(req, CharDecoder())
    outs = []
    for tokens in steps:
        appended = req.append_output(tokens, 0.0, (EOS,))
        out, stopped = proc.append(track, appended.kept_token_ids, None, appended.finish_reason is not None)
        if appended.finish_reason is not None or stopped:
            outs.append(proc.close(track, appended.finish_reason or "stop"))
            return outs, proc
        if out is not None:
            outs.append(out)
    return outs, proc


def test_increments_carry_new_ids_and_text_and_the_last_finishes_at_max_tokens() -> None:
    outs, proc = _run(SamplingParams(max_tokens=3), [[ord("a")], [ord("b")], [ord("c")]])
    assert [o.text for o in outs] == ["a", "b", "c"]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert [o.token_ids for o in outs] == [[97], [98], [99]]
    assert len(proc) == 0  # a closed request is forgotten


def test_a_stop_string_is_cut_and_text_that_may_start_one_is_held_back() -> None:
    outs, _ = _run(SamplingParams(max_tokens=20, stop=("xy",)), [[ord("a")], [ord("x")], [ord("y"), ord("z")]])
    assert "".join(o.text for o in outs) == "a"
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    # "x" was held back while it could still start "xy": no increment sent it
    assert all("x" not in o.text for o in outs)


def test_eos_finishes_with_stop_and_drops_what_follows_it() -> None:
    outs, _ = _run(SamplingParams(max_tokens=20), [[ord("a"), EOS, ord("b")]])
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert outs[-1].completion_tokens == 2  # "a" and the EOS; "b" after it is dropped


def test_find_stop_looks_back_over_text_already_sent() -> None:
    assert find_stop("abcxy", ("xy",), 4) == 3
    assert find_stop("abcxy", ("q", ""), 0) is None


def test_the_text_a_step_works_on_stays_as_short_as_what_is_unsent_however_long_the_output() -> None:
    """A long generation streams the same text, but each step appends to and searches only the unsent text and
    a stop string's lookback, not everything generated so far (which made a step's host work grow with the
    output's length, on every decoding row)."""
    letters = [ord(c) for c in "abcdefghij" * 600]  # 6,000 one-character tokens; "zq" never comes
    for stops in ((), ("",), ("zq",), ("jab", "zq")):  # an empty stop string (the Engine API takes one) cuts nothing
        proc = OutputProcessor()
        req = Request("r", [1, 2, 3], SamplingParams(max_tokens=len(letters) + 1, stop=stops))
        track = proc.add(req, CharDecoder())
        sent = []
        longest = 0
        for t in letters:
            appended = req.append_output([t], 0.0, (EOS,))
            out, stopped = proc.append(track, appended.kept_token_ids)
            if stopped:
                break
            sent.append(out.text if out is not None else "")
            longest = max(longest, len(track.text))
        if "jab" in stops:  # found across tokens, in text partly sent already
            assert stopped and "".join(sent) + proc.close(track, "stop").text == "abcdefghi"
            continue
        assert "".join(sent) + proc.close(track, "length").text == "abcdefghij" * 600
        assert longest <= max(len(s) for s in stops or ("",)) + 1, (stops, longest)

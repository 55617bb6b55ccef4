"""json_chunked.loads parses what json.loads parses, to the same value, and refuses what it refuses."""

from __future__ import annotations

import json
import math

import pytest

from engine.server import json_chunked

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=6))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=4), inner, max_size=4)), max_leaves=30)


def _same(text: str) -> None:
    try:
        want = json.loads(text)
    except ValueError:
        with pytest.raises(ValueError):
            json_chunked.loads(text)
        return
    assert json.dumps(json_chunked.loads(text)) == json.dumps(want)  # NaN != NaN, but prints the same


@settings(max_examples=300, deadline=None)
@given(_values, st.sampled_from([(",", ":"), (", ", ": "), (" ,  ", " : ")]))
def test_valid_json_parses_to_the_same_value(value, separators) -> None:
    _same(json.dumps(value, separators=separators))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='[]{},:"0123456789-.eE tnrufalsNI\\', max_size=30))
def test_broken_json_is_refused_like_json_loads(text) -> None:
    try:
        _same(text)
    except RecursionError:
        pass


def test_long_number_runs_are_parsed_in_pieces_to_the_same_list() -> None:
    ids = list(range(200_000))
    for text in (json.dumps({"prompt": ids}), json.dumps(ids, separators=(",", ":")),
                 json.dumps(ids[:70_000] + ["x", [1, 2]] + ids[:70_000]), json.dumps([1.5, -2e3] * 40_000)):
        _same(text)
    _same("[" + ",".join("7" for _ in range(100_000)) + ",]")  # a trailing comma far into a run is refused
    assert math.isnan(json_chunked.loads("[NaN]")[0])


def test_an_array_past_max_items_is_refused_before_the_rest_is_parsed() -> None:
    text = json.dumps({"a": [1, 2], "prompt": list(range(300_000))})
    assert json_chunked.loads(text, max_items=300_000)["prompt"][-1] == 299_999
    with pytest.raises(json_chunked.TooManyItems):
        json_chunked.loads(text, max_items=70_000)
    with pytest.raises(json_chunked.TooManyItems):
        json_chunked.loads(json.dumps([["x"] * 10]), max_items=5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False)),
                min_size=40, max_size=400),
       st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(list('[]{},:"-+.eE 0x'))), max_size=3))
def test_long_number_runs_with_a_flaw_anywhere_are_refused_or_parsed_like_json_loads(numbers, flaws) -> None:
    text = json.dumps(numbers)
    for at, char in flaws:
        at %= len(text)
        text = text[:at] + char + text[at:]
    try:
        _same(text)
    except RecursionError:
        pass


@pytest.mark.parametrize("piece", ["word ", "line\n", 'say \\"hi\\" ', "é€😀", "\ud800", "\\\\" * 7 + "x"])
def test_strings_longer_than_a_piece_parse_to_the_same_value_in_steps(piece) -> None:
    """A prompt of megabytes is one string: it is scanned and decoded a piece a step, to what json.loads gives
    (escapes, surrogate pairs and lone surrogates, backslash runs cut anywhere), and refused where it refuses."""
    for ensure_ascii in (False, True):
        text = json.dumps({"prompt": piece * (3 * json_chunked.CHUNK_CHARS // len(piece) + 7)},
                          ensure_ascii=ensure_ascii)
        _same(text)
        steps = sum(1 for _ in json_chunked.loads_steps(text))
        assert steps >= 2, "a long string was parsed in one step"
    long = "a" * (2 * json_chunked.CHUNK_CHARS)
    for broken in ('{"p": "' + long + '\x01"}', '{"p": "' + long + '\\q"}', '{"p": "' + long, '["' + long + '\\'):
        _same(broken)


@pytest.mark.parametrize("text, head", [
    ('{"model": "m", "prompt": "hello wor', "hello wor"),
    ('{"prompt": "caf\\u00e9 ok', "café ok"),
    ('{"prompt": "a\\"b\\u00', "a"),  # a cut escape is left out, with what is near it
    ('{"prompt": "tail\\\\', "tail"),
])
def test_a_text_member_the_prefix_ends_inside_is_handed_back_decoded(text: str, head: str) -> None:
    with pytest.raises(json_chunked.UnendedText) as info:
        json_chunked.finish(json_chunked.loads_steps(text, None, {}, frozenset({"prompt"})))
    assert (info.value.member, info.value.head) == ("prompt", head)


def test_an_ended_text_member_or_another_members_text_is_parsed_as_before() -> None:
    with pytest.raises(ValueError) as info:  # the prefix ends later: the usual error, no head
        json_chunked.finish(json_chunked.loads_steps('{"prompt": "a \\" b", "x": "unen', None, {},
                                                     frozenset({"prompt"})))
    assert not isinstance(info.value, json_chunked.UnendedText)
    whole = '{"prompt": "a \\" b", "x": 1}'
    assert json_chunked.loads(whole) == json.loads(whole)

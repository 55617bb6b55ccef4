"""Output processing: sampled token ids in, RequestOutput increments out (vLLM v1's OutputProcessor).

Where the engine delivers a step's outputs, each request's kept tokens (`Scheduler.update`'s TokenOutputs)
come here: this module detokenizes them incrementally, cuts stop strings (holding back text while a stop
string may still be forming), and builds the increments and the final output. Pure Python: the detokenizer is
whatever `tokenizer.incremental_decoder()` returns; a stop string found here goes back to the engine, which
ends the request the way it aborts one (with the reason "stop").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from engine.api import FinishReason, RequestOutput
from engine.core.request import Request


@dataclass
class Track:
    """What output processing keeps per active request: its detokenizer and stop-string state."""

    request: Request
    decoder: Any  # None for a model without a tokenizer: outputs then carry token ids only
    # The text not yet sent, after the last sent characters a stop string could start in (its length - 1):
    # the text a step appends to, and searches, stays as short as what is unsent, however long the output.
    text: str = ""
    sent_chars: int = 0  # where in `text` the unsent part starts
    last_event_s: float = 0.0  # when its last slot event went out (the engine paces them)
    pending: list[int] = field(default_factory=list)  # token ids not yet sent
    pending_logprobs: list[Any] = field(default_factory=list)  # their TokenLogprobs, when the request asked
    cut_by_stop_string: bool = False


class OutputProcessor:
    """The active requests' output state; `append` turns new tokens into increments."""

    def __init__(self) -> None:
        self._tracks: dict[str, Track] = {}

    def add(self, request: Request, decoder: Any) -> Track:
        track = Track(request, decoder)
        self._tracks[request.request_id] = track
        return track

    def get(self, request_id: str) -> Track | None:
        return self._tracks.get(request_id)

    def __iter__(self) -> Iterator[Track]:
        return iter(list(self._tracks.values()))

    def __len__(self) -> int:
        return len(self._tracks)

    def append(self, track: Track, token_ids: list[int], logprobs: list[Any] | None = None,
               finishing: bool = False) -> tuple[RequestOutput | None, bool]:
        """Take the tokens a request kept this step (`Scheduler.update`): (the increment to send now or None,
        whether a stop string ends it). A request that is `finishing`, or that a stop string ends, gets no
        increment here: the caller finishes it (a stop string through the engine's abort path) and `close`
        sends everything that is left.
        """
        req = track.request
        stops = req.params.stop
        track.pending.extend(token_ids)
        if logprobs is not None:  # one per kept token
            track.pending_logprobs.extend(logprobs)
        if track.decoder is not None and token_ids:
            new_text = track.decoder.push(token_ids)
            if new_text:
                track.text += new_text
        # Runs per decoding row per step: a request without stop strings skips the search and holds nothing back.
        if stops:
            stop_at = find_stop(track.text, stops, track.sent_chars)
            if stop_at is not None:
                track.text = track.text[:stop_at]
                track.cut_by_stop_string = True
                return None, True
        if finishing:
            return None, False
        hold = max(0, max(len(s) for s in stops) - 1) if stops else 0  # a stop string may be forming
        upto = max(track.sent_chars, len(track.text) - hold)
        if not track.pending and upto <= track.sent_chars:
            return None, False
        out = self._output(track, track.text[track.sent_chars:upto])
        keep = max(0, upto - hold)  # a stop string never starts in sent text, but it may end past it
        track.text = track.text[keep:]
        track.sent_chars = upto - keep
        return out, False

    def close(self, track: Track, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """The final output of a finished request (the rest of its text); forgets the request."""
        self._tracks.pop(track.request.request_id, None)
        if track.decoder is not None and not track.cut_by_stop_string and reason != "error":
            track.text += track.decoder.flush()
        return self._output(track, track.text[track.sent_chars:], True, reason, error)

    @staticmethod
    def _output(track: Track, text: str, finished: bool = False, reason: FinishReason | None = None,
                error: str | None = None) -> RequestOutput:
        req = track.request
        ids, track.pending = track.pending, []
        logprobs, track.pending_logprobs = track.pending_logprobs, []
        return RequestOutput(req.request_id, ids, text, finished, reason, prompt_tokens=req.num_prompt_tokens,
                             cached_tokens=req.num_cached_tokens, completion_tokens=req.num_output_tokens, error=error,
                             logprobs=logprobs if req.params.logprobs is not None else None)


def find_stop(text: str, stops: tuple[str, ...], sent_chars: int) -> int | None:
    """Index where the earliest stop string starts in text not yet sent (plus a lookback), or None."""
    best: int | None = None
    for stop in stops:
        if not stop:
            continue
        at = text.find(stop, max(0, sent_chars - len(stop) + 1))
        if at != -1 and (best is None or at < best):
            best = at
    return best

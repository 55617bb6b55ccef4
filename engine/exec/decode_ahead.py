"""The next decode step launched before this one's tokens reach the host (greedy rows).

A plain decode step's host work (reading its tokens, detokenizing, stop checks, scheduling the next step, staging
its inputs) used to run while the device sat idle: the device waited for the host and the host for the device.
When every decoding row is greedy its next input is the step's argmax, already on the device, so the next step
can be queued before the host reads this one: the device copies the argmax into the next step's token input,
and the host's work of step N runs while step N+1 computes. The engine takes that step as its next decode when
the next plan decodes exactly those rows with those tokens, and drops it otherwise (a request finished, was
aborted, a prompt arrived): the step it dropped wrote each row's KV at the position after its last token, with
the token the row really emitted, so nothing it left behind is wrong.

A step taken ahead is timed on the device (`step_period_s`): from the end of the step before it, itself launched
ahead, to its own end. The host's wall clock around it would only see the wait for its last part, and the prompt
pacer (engine.core.prefill_pacer) keeps the decoding slots' share of the device by these times.

With MTP's fused step (engine.exec.drafter.verify_and_draft, greedy rows) the same holds one level up: the next
step's pending token is this one's tokens[accepted], its positions this one's plus accepted + 1, and its drafts
are in the draft buffer, all on the device. The fused graph computes the next step's packed inputs itself, so
the step launched ahead stages nothing from the host, and the engine takes it when the rows' real next (slot,
token, position) are the ones the device computed. A dropped fused step puts back the drafts it overwrote.

Only a step whose graph already exists is launched ahead (the same span as the step before): a capture, with its
out-of-memory recovery and its events, happens in a step of its own. Anything that fails while launching ahead
drops that step; the next decode runs as usual and meets the failure on its own path.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import mode_wanted

from engine.exec.runner import Row
from engine.exec.sampler import SampleResult, device_result

if TYPE_CHECKING:
    from engine.exec.drafter import FusedStep, MtpDrafter
    from engine.exec.runner import ModelRunner, StepOutput


def ahead_wanted(mode: str, device: torch.device, graphs: bool, moe: bool) -> bool:
    """`auto`: where it pays (CUDA graphs: an eager step's launches are the host work it would overlap) and no
    expert cache that may miss (`moe`: an MoE model whose cache does not hold every expert at start; with every
    expert resident a replay stands unchecked, and should the cache shrink later each step is checked again
    before it stands); `on` also on a CPU (one stream: the bookkeeping alone, for tests); `off` never.
    ConfigError for `on` where a step's host side must see the step before it. With KV by use a step goes ahead
    only when its blocks need no copy (`DecodeAhead.next_rows_fit`)."""
    blocked = None
    if moe:
        blocked = "cannot launch a decode step ahead here: an MoE model's expert cache that does not hold every " \
                  "expert loads a step's experts from its routing"
    return mode_wanted("decode_ahead", mode, device.type == "cuda" and graphs, blocked)


@dataclass
class _Launched:
    rows: tuple[tuple[int, int, int], ...]  # (slot, token, position) of each real row
    out: StepOutput | FusedStep
    done: torch.cuda.Event | None  # after its replay: waited for when it is dropped
    kind: str = "decode"  # or "verify": MTP's fused step
    drafts: bool = False  # it overwrote its rows' drafts: the backup puts them back if it is dropped


class DecodeAhead:
    """At most one decode step in flight past the one the engine is reading."""

    def __init__(self, runner: ModelRunner, enabled: bool, drafter: MtpDrafter | None = None) -> None:
        self.runner = runner
        self.drafter = drafter  # MTP's fused steps go ahead too when it drafts
        self.enabled = enabled
        self.cuda = runner.device.type == "cuda"
        self._launched: _Launched | None = None
        self._host: dict[tuple, torch.Tensor] = {}  # per output shape and dtype: pinned, for a step's tokens
        self._copied = torch.cuda.Event() if self.cuda else None
        self._drafts: torch.Tensor | None = None  # the draft buffer as the fused step launched ahead found it
        self._last_done: torch.cuda.Event | None = None  # the end of the step taken last, when it was taken ahead
        self._period: tuple | None = None  # (the end of the step before, the end of the step taken) to time
        self.taken = 0  # steps launched ahead that the engine took (the bench and tests read these)
        self.dropped = 0

    @property
    def pending(self) -> bool:
        return self._launched is not None

    def take(self, rows: list[Row], kind: str = "decode") -> StepOutput | FusedStep | None:
        """The step of `kind` launched ahead when it is exactly `rows` (slots, tokens, positions); else None, and
        a step in flight for other rows (or of the other kind) is dropped."""
        launched, self._launched = self._launched, None
        if launched is not None and (launched.kind != kind
                                     or launched.rows != tuple((r.slot, r.token, r.position) for r in rows)):
            self._drop(launched)
            launched = None
        if launched is None:  # this step runs now: the next one taken has no step launched ahead before it
            self._last_done = self._period = None
            return None
        self.taken += 1
        self._period = (self._last_done, launched.done)
        self._last_done = launched.done
        return launched.out

    def step_period_s(self) -> float | None:
        """The device time of the step `take` gave last, from the end of the step before it (once its tokens are
        read); None when either was not launched ahead, or on a CPU."""
        period, self._period = self._period, None
        if period is None or period[0] is None or period[1] is None:
            return None
        return period[0].elapsed_time(period[1]) / 1e3

    def drop(self) -> None:
        """Forget the step in flight, once it has finished (the blocks it writes may change hands next)."""
        launched, self._launched = self._launched, None
        self._last_done = self._period = None
        if launched is not None:
            self._drop(launched)

    def next_rows_fit(self, rows: list[Row], out: StepOutput) -> bool:
        """The next step of `rows` replays the graph this one did: the same span (on the paged kernels' path
        always: ModelRunner.step_span), and, with KV by use, its blocks need no copy nor pool growth."""
        return (self.runner.step_span(max(r.position for r in rows) + 2) == out.span_tokens
                and self._blocks_ready(rows, 2))

    def next_verify_fits(self, rows: list[Row], step: FusedStep) -> bool:
        """The next fused step of `rows` (up to K + 1 tokens on) reads keys within this one's span, so it replays
        this one's graph (on the paged kernels' path always: ModelRunner.step_span); with KV by use, its blocks
        need no copy nor pool growth."""
        k = self.runner.mtp_depth
        return (self.runner.step_span(max(r.position for r in rows) + k + 1 + 2 * k) == step.span
                and self._blocks_ready(rows, 2 * (k + 1)))

    def _blocks_ready(self, rows: list[Row], ahead_tokens: int) -> bool:
        """KV by use: the step after this one may map free blocks (a table update queued after the step in
        flight) but must not spill, fetch or grow the pool (a growth drops the graph it would replay)."""
        paging = self.runner.kv.paging
        if paging is None:
            return True
        lookahead = self.runner.lookahead_tokens
        return paging.maps_only({r.slot: r.position + ahead_tokens + lookahead for r in rows})

    def read_and_launch(self, rows: list[Row], out: StepOutput) -> list[list[int]]:
        """Each row's greedy token of the step `out` (its argmax), with the step after it launched first. A row
        whose logits were not finite reads sampler.NO_TOKEN (the step's `checked`: see sampler.non_finite_rows)."""
        n = len(rows)
        host = self._copy_to_host(out.checked)
        launched = self._launch(rows, out.best)
        tokens = self._read(host)[:n].tolist()
        if launched is not None:
            nxt = tuple((r.slot, t[0], r.position + 1) for r, t in zip(rows, tokens))
            self._launched = _Launched(nxt, *launched)
        return tokens

    def read_and_launch_verify(self, rows: list[Row], step: FusedStep) -> SampleResult:
        """Each row's accepted count and tokens of MTP's fused greedy step, with the step after it launched first
        (a row whose logits were not finite reads sampler.NO_TOKEN: FusedStep.emitted)."""
        host = self._copy_to_host(step.emitted)
        launched = self._launch_verify(rows, step)
        result = device_result(self._read(host), len(rows))
        if launched is not None:
            nxt = tuple((r.slot, toks[-1], r.position + len(toks)) for r, toks in zip(rows, result.tokens))
            self._launched = _Launched(nxt, *launched, kind="verify", drafts=True)
        return result

    def _copy_to_host(self, values: torch.Tensor) -> torch.Tensor:
        """Start copying a step's output to the host, before the next replay overwrites the graph's output."""
        if not self.cuda:
            return values.clone()  # an eager step's outputs are its own; a graph's (CPU: none) would be reused
        key = (tuple(values.shape), values.dtype)
        host = self._host.get(key)
        if host is None:
            host = self._host[key] = torch.empty(values.shape, dtype=values.dtype).pin_memory()
        host.copy_(values, non_blocking=True)
        self._copied.record()
        return host

    def _read(self, host: torch.Tensor) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
        return host

    def _launch(self, rows: list[Row], best: torch.Tensor) -> tuple[StepOutput, torch.cuda.Event | None] | None:
        """The next step of `rows` queued with `best` as its tokens, and its end event; None when it failed."""
        try:
            out = self.runner.decode([Row(r.slot, 0, r.position + 1) for r in rows], tokens=best)
        except Exception:  # noqa: BLE001 - the next decode runs as usual and meets the failure on its own path
            return None
        return out, self._record_done()

    def _launch_verify(self, rows: list[Row], step: FusedStep) -> tuple[FusedStep, torch.cuda.Event | None] | None:
        """The fused step after `step`, from the inputs `step` computed on the device; None when it failed."""
        try:
            # Its positions are on the device only: with KV by use, map every block it may write (its rows moved
            # by up to K + 1, then K + 1 verified and the chain past them), free blocks only (next_verify_fits).
            k1 = self.runner.mtp_depth + 1
            lookahead = self.runner.lookahead_tokens
            self.runner.kv.prepare({r.slot: r.position + 2 * k1 + lookahead for r in rows})
            # The step overwrites its rows' drafts; if it is dropped, the step run in its place verifies the
            # drafts it would have verified without it (the same acceptance, so the same steps, as without it)
            buf = self.runner.draft_buf
            if self._drafts is None or self._drafts.shape != buf.shape:
                self._drafts = torch.empty_like(buf)
            self._drafts.copy_(buf)
            out = self.drafter.verify_and_draft_ahead(step)
        except Exception:  # noqa: BLE001 - the next step runs as usual and meets the failure on its own path
            return None
        return out, self._record_done()

    def _record_done(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        return done

    def _drop(self, launched: _Launched) -> None:
        self.dropped += 1
        with contextlib.suppress(Exception):  # a failed device reports itself on the next step's own path
            if launched.done is not None:
                launched.done.synchronize()
            if launched.drafts and self._drafts is not None:  # its rows only: other slots' drafts may be newer
                slots = torch.tensor([row[0] for row in launched.rows], device=self._drafts.device)
                self.runner.draft_buf.index_copy_(0, slots, self._drafts.index_select(0, slots))

"""Error classification and real-message extraction (engine/exec/gpu_errors.py)."""

from __future__ import annotations

import pytest
import torch

from tests.fault_injection import ERRORS
from engine.exec.gpu_errors import (StickyCudaError, classify, error_event, exception_chain, is_oom, is_sticky,
                               real_message, sticky_from, vram_free_mib)

BOILERPLATE = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
               "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")


def _raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer from e
    except BaseException as e:
        return e


def test_instantiate_oom_is_a_runtime_error_not_out_of_memory_error_and_still_oom() -> None:
    exc = RuntimeError("CUDA error: out of memory" + BOILERPLATE)
    assert not isinstance(exc, torch.OutOfMemoryError)
    assert is_oom(exc) and not is_sticky(exc) and classify(exc) == "oom"
    msg = real_message(exc)
    assert msg == "RuntimeError: CUDA error: out of memory", msg  # boilerplate lines dropped


def test_capture_invalidated_caused_by_oom_names_both() -> None:
    inner = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
    exc = _raised_from(RuntimeError("CUDA error: operation failed due to a previous error during capture"), inner)
    assert classify(exc) == "oom"
    msg = real_message(exc)
    assert msg.startswith("RuntimeError: CUDA error: operation failed due to a previous error during capture")
    assert "(caused by OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.)" in msg


def test_a_no_error_status_is_skipped_for_the_real_cause_in_context() -> None:
    try:
        try:
            raise RuntimeError("CUDA error: out of memory")
        except RuntimeError:
            raise RuntimeError("mtp: round capture: no error")
    except RuntimeError as e:
        exc = e
    msg = real_message(exc)
    assert msg == "RuntimeError: CUDA error: out of memory"
    assert "no error" not in msg.lower()


@pytest.mark.parametrize("exc", [RuntimeError(), RuntimeError("no error"), ValueError("CUDA error: no error"),
                                 RuntimeError("   \n  ")], ids=["empty", "no-error", "value-no-error", "blank"])
def test_never_no_error_and_never_empty_falls_back_to_type_and_repr(exc: BaseException) -> None:
    msg = real_message(exc)
    assert msg, "empty message emitted"
    assert "no error" not in msg.lower()
    assert msg.startswith(type(exc).__name__)


@pytest.mark.parametrize("name", sorted(ERRORS))
@pytest.mark.parametrize("stage", ["capture", "instantiate"])
def test_every_injectable_error_yields_a_usable_message(name: str, stage: str) -> None:
    msg = real_message(ERRORS[name](stage, "[t]"))
    assert msg and "no error" not in msg.lower()


def test_sticky_errors_are_classified_before_oom() -> None:
    for text in ("CUDA error: an illegal memory access was encountered", "CUDA error: device-side assert triggered",
                 "CUDA error: unspecified launch failure", "CUDA error: misaligned address"):
        assert classify(RuntimeError(text)) == "sticky", text
    both = _raised_from(RuntimeError("CUDA error: an illegal memory access was encountered"),
                        RuntimeError("CUDA error: out of memory"))
    assert classify(both) == "sticky"
    assert classify(RuntimeError("operation not permitted when stream is capturing")) == "other"
    assert classify(ValueError("shape mismatch")) == "other"


def test_chain_walk_survives_cycles() -> None:
    a, b = RuntimeError("a"), RuntimeError("CUDA error: out of memory")
    a.__context__, b.__context__ = b, a
    assert [str(x) for x in exception_chain(a)] == ["a", "CUDA error: out of memory"]
    assert is_oom(a)


def test_vram_free_is_unknown_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert vram_free_mib() is None and vram_free_mib("cpu") is None


def test_sticky_error_becomes_a_fatal_error_event_with_the_real_message() -> None:
    exc = RuntimeError("CUDA error: an illegal memory access was encountered" + BOILERPLATE)
    sticky = sticky_from(exc, "engine step")
    assert isinstance(sticky, StickyCudaError)
    ev = sticky.to_event()
    assert ev.fatal and ev.where == "engine step" and ev.exc_type == "RuntimeError"
    assert ev.message == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert sticky_from(sticky, "elsewhere") is sticky
    plain = error_event(ValueError("bad slot 9"), "engine step")
    assert not plain.fatal and plain.message == "ValueError: bad slot 9"
    assert error_event(exc, "engine step").fatal


def test_allocator_advice_is_cut_but_its_figures_stay() -> None:
    text = ("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
            "290.00 MiB is free. Of the allocated memory 120.00 GiB is allocated by PyTorch. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    msg = real_message(torch.OutOfMemoryError(text))
    assert msg.endswith("120.00 GiB is allocated by PyTorch.") and "290.00 MiB is free" in msg


# What torch appends to every CUDA error (c10/cuda), its third line included: "device-side assertions" in it
# made every CUDA error sticky, an instantiate's out-of-memory and a capture that torch.compile broke alike (so an
# engine under COMPILE would exit on "operation not permitted when stream is capturing" instead of degrading).
TORCH_TAIL = BOILERPLATE + "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"


class BackendCompilerFailed(RuntimeError):
    """Named like torch._dynamo.exc.BackendCompilerFailed, which wraps what Inductor raised."""


def test_torchs_own_tail_does_not_make_an_error_sticky() -> None:
    assert classify(RuntimeError("CUDA error: out of memory" + TORCH_TAIL)) == "oom"
    broke = _raised_from(BackendCompilerFailed("backend='inductor' raised: AcceleratorError: CUDA error: operation "
                                               "not permitted when stream is capturing" + TORCH_TAIL),
                         RuntimeError("CUDA error: operation not permitted when stream is capturing" + TORCH_TAIL))
    assert classify(broke) == "other"
    assert classify(RuntimeError("CUDA error: device-side assert triggered" + TORCH_TAIL)) == "sticky"
    assert classify(RuntimeError("CUDA error: an illegal memory access was encountered" + TORCH_TAIL)) == "sticky"

"""Start-up failures name their stage: a bare "CUDA error: out of memory" while the engine is being built (as
when memory runs out before the tier has measured its room) says neither where nor how much was free."""

from __future__ import annotations

import pytest

from engine.orchestration.engine_setup import StartupError
from engine.errors import ConfigError
from engine.core.scheduler import Scheduler
from tests.engine.engine_helpers import make_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_failure_while_building_names_the_stage_the_real_error_and_the_engine_frame(ckpt, monkeypatch) -> None:
    def failing_from_config(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some "
                           "other API call, so the stacktrace below might be incorrect.")

    monkeypatch.setattr(Scheduler, "from_config", staticmethod(failing_from_config))
    with pytest.raises(StartupError) as info:
        make_engine(ckpt, batch=2)
    text = str(info.value)
    assert text.startswith("while building the scheduler, runner and drafter: RuntimeError: CUDA error: out of memory")
    assert "asynchronously" not in text  # PyTorch's boilerplate is not the news
    assert info.value.where is not None and info.value.where.startswith("engine/orchestration/engine_setup.py:")
    assert info.value.where.endswith("in _executors") and f"at {info.value.where}" in text  # the stage's method
    assert isinstance(info.value.__cause__, RuntimeError)
    # What /health and the serve's one-line error show: the cause once, not repeated after the wrapper.
    from engine.exec.gpu_errors import real_message

    assert real_message(info.value).count("CUDA error: out of memory") == 1


def test_errors_that_already_name_their_option_pass_through_unchanged(tmp_path) -> None:
    from engine.model.random_checkpoint import write_random_checkpoint

    plain = write_random_checkpoint(tmp_path / "plain", size="tiny")  # no MTP head
    with pytest.raises(ConfigError, match="batch_mtp=True.*no MTP head"):
        make_engine(plain, batch=2, batch_mtp=True)

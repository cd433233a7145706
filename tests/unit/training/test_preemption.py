"""trainer.training.preemption: the handler's bookkeeping and the callback's save-and-stop request."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
from transformers import TrainerControl

from trainer.training import preemption
from trainer.training.preemption import PreemptionCallback, TrainingInterrupted


class Exited(Exception):
    pass


@pytest.fixture
def exits(monkeypatch):
    codes = []

    def fake_exit(code):
        codes.append(code)
        raise Exited

    monkeypatch.setattr(preemption.os, "_exit", fake_exit)
    return codes


def step_end(callback: PreemptionCallback, step: int = 7) -> TrainerControl:
    args = SimpleNamespace(world_size=1, device="cpu")
    state = SimpleNamespace(global_step=step)
    return callback.on_step_end(args, state, TrainerControl(should_evaluate=True))


def test_a_signal_turns_the_step_end_into_save_and_stop(exits, capsys):
    callback = PreemptionCallback()
    control = step_end(callback)
    assert not (control.should_save or control.should_training_stop)
    callback._handle(signal.SIGTERM, None)
    assert "received SIGTERM: finishing the current step" in capsys.readouterr().err
    control = step_end(callback)
    assert control.should_save and control.should_training_stop and not control.should_evaluate
    assert (callback.signum, callback.stopped_at_step) == (signal.SIGTERM, 7)
    assert exits == []


def test_a_copy_of_the_same_signal_is_not_a_second_request(exits, monkeypatch):
    clock = iter([100.0, 100.4, 103.0])
    monkeypatch.setattr(preemption.time, "monotonic", lambda: next(clock))
    callback = PreemptionCallback()
    callback._handle(signal.SIGTERM, None)
    callback._handle(signal.SIGTERM, None)  # 0.4 s later: scheduler and torchrun both delivered it
    assert exits == []
    with pytest.raises(Exited):
        callback._handle(signal.SIGTERM, None)  # 3 s later: the user means it
    assert exits == [128 + signal.SIGTERM]


def test_a_different_second_signal_exits_at_once(exits):
    callback = PreemptionCallback()
    callback._handle(signal.SIGTERM, None)
    with pytest.raises(Exited):
        callback._handle(signal.SIGINT, None)
    assert exits == [130]


def test_only_rank_zero_speaks(exits, capsys):
    PreemptionCallback(process_index=3)._handle(signal.SIGINT, None)
    assert capsys.readouterr().err == ""


def test_install_and_uninstall_restore_the_previous_handlers():
    before = {signum: signal.getsignal(signum) for signum in preemption.HANDLED_SIGNALS}
    callback = PreemptionCallback()
    callback.install()
    assert all(signal.getsignal(signum) == callback._handle for signum in before)
    callback.uninstall()
    assert {signum: signal.getsignal(signum) for signum in before} == before


def test_the_interruption_message_and_status():
    stop = TrainingInterrupted(signal.SIGTERM, 12, "run/checkpoint-12")
    assert str(stop) == (
        "stopped by SIGTERM after step 12: saved a complete checkpoint at run/checkpoint-12; "
        "run the same command with --resume_from_checkpoint true to continue"
    )
    assert stop.exit_status == 143

"""trainer.training.preemption: the handler's bookkeeping and the callback's save-and-stop request."""

from __future__ import annotations

import signal
from types import SimpleNamespace
from typing import ClassVar

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


@pytest.fixture
def restored_handlers():
    before = {signum: signal.getsignal(signum) for signum in preemption.HANDLED_SIGNALS}
    yield before
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_holding_until_exit_swaps_the_handlers_and_uninstall_brings_back_the_first(restored_handlers):
    callback = PreemptionCallback()
    callback.install()
    callback.hold_until_exit()  # straight from the training handler: never the default in between
    assert all(signal.getsignal(signum) == callback._handle_while_ending for signum in restored_handlers)
    callback.uninstall()
    assert {signum: signal.getsignal(signum) for signum in restored_handlers} == restored_handlers


def test_a_held_signal_is_silent_and_ends_the_process_only_after_the_grace(monkeypatch, capsys):
    exited = []
    monkeypatch.setattr(preemption.os, "_exit", exited.append)
    monkeypatch.setattr(preemption, "ENDING_GRACE_S", 0.2)
    callback = PreemptionCallback()
    callback.signum = signal.SIGTERM  # the run itself stopped on SIGTERM, long ago: this is no second one
    callback._handle_while_ending(signal.SIGTERM, None)
    assert exited == [] and capsys.readouterr().err == ""
    assert callback.ending_signal == signal.SIGTERM
    deadline = preemption.time.monotonic() + 10
    while not exited and preemption.time.monotonic() < deadline:
        preemption.time.sleep(0.02)
    assert exited == [143]


class UnstartedTimer:
    """threading.Timer's calls, recorded (in `made`, set by the test); nothing runs."""

    made: ClassVar[list[tuple]]

    def __init__(self, interval, function, args) -> None:
        self.made.append((interval, function, args))

    def start(self) -> None:
        pass


def test_while_held_a_copy_waits_and_a_second_signal_exits_at_once(exits, monkeypatch):
    monkeypatch.setattr(UnstartedTimer, "made", [], raising=False)
    monkeypatch.setattr(preemption.threading, "Timer", UnstartedTimer)
    clock = iter([100.0, 100.4, 100.5])
    monkeypatch.setattr(preemption.time, "monotonic", lambda: next(clock))
    callback = PreemptionCallback()
    callback._handle_while_ending(signal.SIGTERM, None)
    callback._handle_while_ending(signal.SIGTERM, None)  # the launcher's copy of the scheduler's
    assert exits == [] and UnstartedTimer.made == [(preemption.ENDING_GRACE_S, preemption.os._exit, [143])]
    with pytest.raises(Exited):
        callback._handle_while_ending(signal.SIGINT, None)  # Ctrl-C: the user will not wait
    assert exits == [130]


@pytest.mark.parametrize(
    ("world_size", "failed", "stopped_at_step", "held"),
    [(1, True, 4, False), (2, False, None, False), (2, True, None, True), (2, False, 4, True)],
)
def test_after_training_holds_only_a_stopped_rank_of_a_multi_rank_job(
    restored_handlers, world_size, failed, stopped_at_step, held
):
    callback = PreemptionCallback()
    callback.install()
    callback.stopped_at_step = stopped_at_step
    callback.after_training(failed=failed, world_size=world_size)
    handler = signal.getsignal(signal.SIGTERM)
    assert handler == (callback._handle_while_ending if held else restored_handlers[signal.SIGTERM])

"""trainer.training.watchdog without processes: heartbeat bookkeeping, stale and dead peers, who speaks, the lines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from trainer.training import watchdog as wd
from trainer.training.arguments import DFlashTrainingArguments
from trainer.training.watchdog import DONE, EXITED, HeartbeatTable, LostRank, ProcessIdentity, Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FailingStore:
    """A store that stopped answering (its host is stopped): every operation times out."""

    def __init__(self, store) -> None:
        self.store, self.failing = store, False

    def __getattr__(self, name):
        if self.failing:
            raise torch.distributed.DistStoreError("wait timeout after 2000ms")
        return getattr(self.store, name)


class Exited(Exception):
    pass


def watchdog(rank: int = 0, world_size: int = 3, timeout: float = 10.0, store=None, **kwargs) -> Watchdog:
    """A watchdog on an in-process store, with a fake clock and an exit that raises instead."""

    def exit_(status: int) -> None:
        raise Exited(status)

    kwargs.setdefault("clock", Clock())
    return Watchdog(store or torch.distributed.HashStore(), rank, world_size, timeout, exit=exit_, **kwargs)


def beat(dog: Watchdog, rank: int, value: str | bytes) -> None:
    dog.store.set(dog.key(rank), value)


def advance(dog: Watchdog, seconds: float, beating: tuple[int, ...] = ()) -> LostRank | None:
    """Tick once a second for `seconds`; the `beating` peers bump their counters meanwhile."""
    lost = None
    for _ in range(int(seconds)):
        dog.clock.now += 1.0
        for rank in beating:
            beat(dog, rank, str(dog.clock.now))
        lost = dog.tick()
        if lost is not None:
            return lost
    return lost


def test_the_table_judges_silence_on_this_ranks_clock():
    table = HeartbeatTable([1, 2], now=0.0)
    table.observe(1, b"1", 1.0)
    table.observe(2, b"1", 1.0)
    table.observe(1, b"2", 5.0)
    table.observe(2, b"1", 5.0)  # the same value again is no heartbeat
    assert table.silent(12.0, 10.0) == {2: 11.0}
    table.observe(2, DONE, 12.0)  # a rank that finished is never silent
    assert table.silent(30.0, 10.0) == {1: 25.0}
    table.rebaseline(30.0)
    assert table.silent(35.0, 1.0) == {1: 5.0}


def test_a_peer_whose_heartbeat_stops_is_named_after_the_timeout():
    dog = watchdog(timeout=10.0)
    dog.phase = "during step 37"
    assert advance(dog, 9, beating=(1, 2)) is None
    lost = advance(dog, 30, beating=(2,))
    assert lost == LostRank(
        "rank 1 stopped responding (no heartbeat for 11 s) during step 37: stopping this rank", frozenset({1})
    )


def test_a_peer_that_never_beats_is_named_too():
    dog = watchdog(timeout=5.0)
    lost = advance(dog, 30, beating=(1,))
    assert lost is not None and lost.culprits == {2} and lost.message.startswith("rank 2 stopped responding")


def test_finished_and_exited_peers_are_never_reported():
    dog = watchdog(timeout=5.0)
    beat(dog, 1, DONE)
    beat(dog, 2, EXITED)
    assert advance(dog, 60) is None


def test_a_pause_of_this_rank_itself_is_not_blamed_on_the_others():
    dog = watchdog(timeout=10.0, interval=1.0)
    assert advance(dog, 3, beating=(1, 2)) is None
    dog.clock.now += 600.0  # the whole job was stopped (Ctrl-Z) or the host suspended, then resumed
    assert dog.tick() is None
    assert advance(dog, 5, beating=(1, 2)) is None


def test_a_store_that_stops_answering_names_the_rank_hosting_it():
    store = FailingStore(torch.distributed.HashStore())
    dog = watchdog(rank=1, world_size=2, timeout=5.0, store=store, store_address="node0:29500", store_on_rank=0)
    dog.phase = "during step 3"
    assert advance(dog, 2, beating=(0,)) is None
    store.failing = True
    lost = advance(dog, 30)
    assert lost == LostRank(
        "rank 0 stopped responding (the job's c10d store at node0:29500, which it hosts, gave no answer for 6 s) "
        "during step 3: stopping this rank",
        frozenset({0}),
    )
    agent_hosted = watchdog(rank=1, world_size=2, timeout=5.0, store=store, store_address="node0:29500")
    assert advance(agent_hosted, 30).message == (
        "the job's c10d store at node0:29500 stopped answering (for 6 s) before training: stopping this rank"
    )


@pytest.fixture
def gone_process() -> ProcessIdentity:
    """The identity of a process of this host that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = ProcessIdentity.of_this_process()
    identity = ProcessIdentity(identity.host, child.pid, identity.start)
    child.wait(timeout=30)
    return identity


def test_a_peer_process_gone_from_this_host_is_named_at_once(gone_process):
    dog = watchdog(rank=0, world_size=2, timeout=300.0)
    dog.store.set(dog.key(1, "who"), gone_process.encode())
    beat(dog, 1, "7")
    dog.phase = "during step 5"
    assert dog.tick() == LostRank("rank 1 died (its process is gone) during step 5: stopping this rank", frozenset({1}))
    beat(dog, 1, DONE)  # it finished the run before it exited: nothing to report
    assert dog.tick() is None


def test_only_the_processes_of_this_nodes_ranks_are_looked_at(gone_process, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert wd.node_ranks(5) == range(4, 6)
    dog = watchdog(rank=5, world_size=8, local_peers=wd.node_ranks(5))
    dog.store.set(dog.key(0, "who"), gone_process.encode())  # another node's rank: its pid means nothing here
    assert dog.tick() is None
    dog.store.set(dog.key(4, "who"), gone_process.encode())
    assert dog.tick().culprits == {4}
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert wd.node_ranks(5) is None


def test_a_live_process_is_running_or_stopped_and_other_hosts_are_not_judged():
    me = ProcessIdentity.of_this_process()
    assert wd.process_state(me, me.host) == "running"
    assert wd.process_state(ProcessIdentity(me.host, me.pid, "123"), me.host) == "gone"  # a reused pid
    assert wd.process_state(me, "another-host") == "elsewhere"
    assert ProcessIdentity.decode(me.encode()) == me


def test_a_closed_connection_in_a_collective_names_the_peer_whose_heartbeat_stopped(monkeypatch):
    dog = watchdog(rank=1, world_size=3, timeout=300.0, interval=1.0)
    monkeypatch.setattr(wd.time, "sleep", lambda seconds: advance(dog, 1, beating=(2,)))
    advance(dog, 3, beating=(0, 2))
    dog.phase = "during step 9"
    error = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.7]:12184")
    assert dog.explain(error) == LostRank(
        "rank 0 died (its connection closed and its heartbeat stopped) during step 9: stopping this rank",
        frozenset({0}),
    )
    assert dog.explain(RuntimeError("CUDA out of memory")) is None
    assert dog.explain(ValueError("connection closed by peer")) is None


def test_a_closed_connection_with_every_heartbeat_current_still_says_so(monkeypatch):
    dog = watchdog(rank=0, world_size=2, timeout=300.0, interval=1.0)
    monkeypatch.setattr(wd.time, "sleep", lambda seconds: advance(dog, 1, beating=(1,)))
    lost = dog.explain(RuntimeError("Connection reset by peer"))
    assert lost is not None and lost.culprits == frozenset()
    assert "which rank is unknown" in lost.message
    beat(dog, 1, EXITED)
    dog.tick()
    assert dog.explain(RuntimeError("Connection reset by peer")).message == (
        "rank 1 stopped on its own error before training (its connection closed; the error is in its output): "
        "stopping this rank"
    )


def test_a_timed_out_collective_is_one_line_too():
    dog = watchdog(rank=0, world_size=2, timeout=300.0, interval=1.0)
    advance(dog, 2, beating=(1,))
    error = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1800000ms for recv operation")
    assert dog.explain(error).message == (
        "a collective timed out before training (ddp_timeout) although every rank's heartbeat is current: a rank "
        "is alive but stuck outside the collective: stopping this rank"
    )
    advance(dog, 3)
    assert dog.explain(error) == LostRank(
        "rank 1 died (a collective waiting for it timed out and its heartbeat stopped) before training: stopping "
        "this rank",
        frozenset({1}),
    )


@pytest.mark.parametrize(("rank", "speaks"), [(2, True), (3, False)])
def test_only_the_lowest_surviving_rank_prints_and_every_survivor_exits_1(rank, speaks, monkeypatch, capsys):
    slept: list[float] = []
    monkeypatch.setattr(wd.time, "sleep", slept.append)
    dog = watchdog(rank=rank, world_size=4, timeout=10.0)
    beat(dog, 1, DONE)  # rank 0 is lost and rank 1 finished: rank 2 is the lowest survivor
    dog.tick()
    lost = LostRank("rank 0 stopped responding (no heartbeat for 11 s) during step 2: stopping this rank", {0})
    with pytest.raises(Exited) as exited:
        dog.report(lost)
    assert exited.value.args == (wd.LOST_RANK_STATUS,)
    printed = capsys.readouterr().err
    assert printed == (f"\nerror: {lost.message}\n" if speaks else "")  # on a line of its own, whatever came before
    assert bool(slept) is not speaks  # a silent rank gives the speaker time to print


def test_a_stopped_peer_on_this_host_is_killed_before_exiting(capsys):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while wd._proc_stat(sleeper.pid)[0] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        host, start = ProcessIdentity.of_this_process().host, wd._proc_stat(sleeper.pid)[1]
        dog = watchdog(rank=0, world_size=2)
        dog.store.set(dog.key(1, "who"), ProcessIdentity(host, sleeper.pid, start).encode())
        with pytest.raises(Exited):
            dog.report(LostRank("rank 1 stopped responding", frozenset({1})))
        assert sleeper.wait(timeout=30) == -9
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)


def test_watched_run_marks_this_rank_exited_on_its_own_error_and_done_otherwise(monkeypatch):
    dog = watchdog(rank=0, world_size=2)
    monkeypatch.setattr(wd, "_active", dog)
    with pytest.raises(ValueError), wd.watched_run():
        raise ValueError("recipe field max_steps: 'four' is not an int")
    assert dog.store.get(dog.key(0)) == EXITED and wd._active is None
    monkeypatch.setattr(wd, "_active", dog)
    with wd.watched_run():
        pass
    assert dog.store.get(dog.key(0)) == DONE


def test_watched_run_turns_a_lost_peer_into_its_report(monkeypatch, gone_process, capsys):
    dog = watchdog(rank=0, world_size=2)
    dog.store.set(dog.key(1, "who"), gone_process.encode())
    dog.phase = "during step 4"
    monkeypatch.setattr(wd, "_active", dog)
    with pytest.raises(Exited), wd.watched_run():
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4711")
    assert capsys.readouterr().err == (
        "\nerror: rank 1 died (its process is gone; its connection closed) during step 4: stopping this rank\n"
    )
    with pytest.raises(RuntimeError), wd.watched_run(debug=True):  # --debug: the traceback instead
        raise RuntimeError("Connection closed by peer [127.0.0.1]:4711")


def test_the_heartbeat_interval_follows_the_timeout():
    assert wd.heartbeat_interval(300.0) == wd.MAX_INTERVAL_S
    assert wd.heartbeat_interval(5.0) == 1.0
    assert wd.heartbeat_interval(0.1) == wd.MIN_INTERVAL_S


def test_rank_stall_timeout_defaults_to_five_minutes_and_refuses_negative_values(tmp_path):
    assert DFlashTrainingArguments(output_dir=str(tmp_path), use_cpu=True).rank_stall_timeout == 300.0
    with pytest.raises(ValueError, match="rank_stall_timeout must be >= 0 seconds"):
        DFlashTrainingArguments(output_dir=str(tmp_path), use_cpu=True, rank_stall_timeout=-1)


def test_a_single_process_run_starts_no_watchdog(tmp_path):
    args = DFlashTrainingArguments(output_dir=str(tmp_path), use_cpu=True, rank_stall_timeout=5)
    assert wd.start_watchdog(args) == [] and wd._active is None

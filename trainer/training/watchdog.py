"""Liveness of the other ranks: a rank that dies or stalls ends the job in bounded time, named in one line.

A rank that is stopped (SIGSTOP, a wedged host, a network partition) keeps its sockets open, so the
others wait in their next collective until the process-group timeout (HF `ddp_timeout`, 30 min by
default; NCCL hangs as long); a rank that is killed makes gloo raise "Connection closed by peer" at
once, but as a traceback that does not say which rank died.

So every rank runs a heartbeat thread on the job's c10d store (the TCPStore torchrun / accelerate
create): every `interval` seconds it bumps a counter under its own key and reads everyone else's,
with a store timeout so a store that stops answering is noticed too. Staleness is judged on this
rank's own monotonic clock (when did the peer's counter last change?), never by comparing clocks of
different hosts. A peer silent for `rank_stall_timeout` seconds, or one on this host whose process
is gone, ends this rank: the lowest surviving rank prints one line naming the lost rank, a stopped
peer on this host is killed (it could not act on the launcher's SIGTERM, which would hold the job for
the launcher's 30 s kill timeout) and the rank leaves with `os._exit` (the main thread is stuck in a
collective, so nothing else could end it). A collective that fails in the main thread because a
peer's connection closed is turned into the same kind of line by `watched_run` (see `trainer.commands.runner`).

The heartbeat shows the process is alive, not that it makes progress: a live rank whose main thread
hangs is left to the process-group timeout. Ranks that finish (`close_process_group`) or stop on an
error of their own mark their key first, so the others never report them.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

import torch
from transformers import TrainerCallback

from trainer.console import close_progress_bars

logger = logging.getLogger(__name__)

MAX_INTERVAL_S = 5.0  # a heartbeat at least this often; 1/5 of the timeout when that is shorter
MIN_INTERVAL_S = 0.2
LOST_RANK_STATUS = 1
DONE = b"done"  # the rank finished the run (after the last barrier)
EXITED = b"exited"  # the rank stops on an error of its own; it reports that error itself
# How gloo (and NCCL's socket transport) word a collective whose peer went away.
PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "remote worker crashing",
)
COLLECTIVE_TIMEOUT_MARKERS = ("timed out waiting",)  # gloo, after the process-group timeout

_active: Watchdog | None = None


def heartbeat_interval(timeout: float) -> float:
    """Seconds between heartbeats: five or more per timeout, at most MAX_INTERVAL_S apart."""
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, timeout / 5))


def name_ranks(ranks: Iterable[int]) -> str:
    """`rank 3`, `ranks 1, 3`."""
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(str(rank) for rank in ordered)


# -- processes on this host ------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessIdentity:
    """Where a rank runs: host, pid and the pid's start time (so a reused pid is not mistaken for it)."""

    host: str
    pid: int
    start: str

    def encode(self) -> bytes:
        return f"{self.host} {self.pid} {self.start}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> ProcessIdentity:
        host, pid, start = raw.decode().rsplit(" ", 2)
        return cls(host, int(pid), start)

    @classmethod
    def of_this_process(cls) -> ProcessIdentity:
        return cls(socket.gethostname(), os.getpid(), _proc_stat(os.getpid())[1] or "?")


def _proc_stat(pid: int) -> tuple[str | None, str | None]:
    """(state letter, start time) from /proc/PID/stat; (None, None) when the process does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None, None
    except OSError:  # no /proc (not Linux): only existence can be told
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None, None
        except PermissionError:
            pass
        return "?", "?"
    return fields[0], fields[19]


def process_state(identity: ProcessIdentity, host: str) -> str:
    """`gone`, `stopped`, `running`, or `elsewhere` for a process on another host."""
    if identity.host != host:
        return "elsewhere"
    state, start = _proc_stat(identity.pid)
    if state is None or state in "ZX" or (identity.start != "?" and start not in ("?", identity.start)):
        return "gone"
    return "stopped" if state == "T" else "running"


# -- the bookkeeping -------------------------------------------------------------------------------


class HeartbeatTable:
    """The other ranks' last heartbeat values, and when (on this rank's clock) each last changed."""

    def __init__(self, peers: Iterable[int], now: float) -> None:
        self.values: dict[int, bytes | None] = dict.fromkeys(peers)
        self.changed_at: dict[int, float] = dict.fromkeys(self.values, now)

    def observe(self, rank: int, value: bytes | None, now: float) -> None:
        if value != self.values[rank]:
            self.values[rank], self.changed_at[rank] = value, now

    def rebaseline(self, now: float) -> None:
        """This rank itself was not running (stopped, suspended): silence seen meanwhile proves nothing."""
        self.changed_at = dict.fromkeys(self.values, now)

    def finished(self, rank: int) -> bool:
        return self.values[rank] in (DONE, EXITED)

    def silent(self, now: float, longer_than: float) -> dict[int, float]:
        """Ranks still in the run whose heartbeat has not changed for more than `longer_than` seconds."""
        return {
            rank: now - changed
            for rank, changed in self.changed_at.items()
            if not self.finished(rank) and now - changed > longer_than
        }


@dataclass(frozen=True)
class LostRank:
    """What one rank has to say about lost peers: the line (without `error: `) and whom it names."""

    message: str
    culprits: frozenset[int]


def stalled(ranks: dict[int, float], phase: str) -> LostRank:
    age = min(ranks.values())
    return LostRank(
        f"{name_ranks(ranks)} stopped responding (no heartbeat for {age:.0f} s) {phase}: stopping this rank",
        frozenset(ranks),
    )


def died(ranks: Iterable[int], how: str, phase: str) -> LostRank:
    ranks = frozenset(ranks)
    return LostRank(f"{name_ranks(ranks)} died ({how}) {phase}: stopping this rank", ranks)


# -- the watchdog ------------------------------------------------------------------------------------


class Watchdog:
    """One rank's heartbeat thread and its judgement of the others (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout: float,
        *,
        namespace: str = "dflash2_watchdog/0",
        store_address: str = "",
        store_on_rank: int | None = None,
        local_peers: Iterable[int] | None = None,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        stream: TextIO | None = None,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self.namespace, self.store_address, self.store_on_rank = namespace, store_address, store_on_rank
        self.interval = interval or heartbeat_interval(timeout)
        self.clock, self.stream, self._exit = clock, stream, exit
        self.phase = "before training"
        self.host = socket.gethostname()
        self.peers = [rank_ for rank_ in range(world_size) if rank_ != rank]
        # the peers that may run on this host (whose processes can be looked at); None: any of them
        self.local_peers = self.peers if local_peers is None else sorted(set(local_peers) - {rank})
        now = clock()
        self.table = HeartbeatTable(self.peers, now)
        self.identities: dict[int, ProcessIdentity] = {}
        self.store_answered_at = now
        self._last_tick_end = now
        self._beats = 0
        self._lock = threading.Lock()
        self._report_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def key(self, rank: int, what: str = "beat") -> str:
        return f"{self.namespace}/{what}/{rank}"

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self.store.set(self.key(self.rank, "who"), ProcessIdentity.of_this_process().encode())
        self.tick()
        self._thread = threading.Thread(target=self._run, name="dflash2-watchdog", daemon=True)
        self._thread.start()

    def finish(self, how: bytes = DONE) -> None:
        """Stop watching and tell the others not to report this rank (best effort: the store may be gone)."""
        self._stopping.set()
        with contextlib.suppress(Exception):
            self.store.set(self.key(self.rank), how)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval)  # a daemon; it reports nothing once stopping is set

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                lost = self.tick()
            except Exception:  # a bug here must not take the run down; the run goes on unwatched
                logger.exception("The rank watchdog failed; other ranks are no longer watched.")
                return
            if lost is not None and not self._stopping.is_set():
                self.report(lost)

    # -- one heartbeat -------------------------------------------------------------------------

    def tick(self) -> LostRank | None:
        """Beat, read the others, judge; the finding when a peer is lost, else None."""
        started = self.clock()
        with self._lock:
            if started - self._last_tick_end > 3 * self.interval:
                # this thread did not run for a while (the process was stopped or starved): start afresh
                self.table.rebaseline(started)
                self.store_answered_at = started
        self._beats += 1
        try:
            self.store.set(self.key(self.rank), str(self._beats))
            values = self._read(self.peers)
        except (RuntimeError, OSError):  # DistStoreError (a RuntimeError): timed out or connection lost
            values = None
        now = self.clock()
        with self._lock:
            if values is not None:
                self.store_answered_at = now
                for rank, value in values.items():
                    self.table.observe(rank, value, now)
            self._last_tick_end = now
        return self.judge(now)

    def _read(self, ranks: list[int]) -> dict[int, bytes | None]:
        """The ranks' heartbeat values; None for a rank that has not written one yet (multi_get would wait)."""
        keys = [self.key(rank) for rank in ranks]
        if not keys:
            return {}
        if self.store.check(keys):
            return dict(zip(ranks, self.store.multi_get(keys), strict=True))
        pairs = zip(ranks, keys, strict=True)
        return {rank: self.store.get(key) if self.store.check([key]) else None for rank, key in pairs}

    def judge(self, now: float) -> LostRank | None:
        with self._lock:
            silent_store = now - self.store_answered_at
            if silent_store > self.timeout:
                return self._store_lost(silent_store)
            gone = self._gone_here()
            if gone:
                return died(gone, "its process is gone", self.phase)
            silent = self.table.silent(now, self.timeout)
        return stalled(silent, self.phase) if silent else None

    def _store_lost(self, age: float) -> LostRank:
        where = f"the job's c10d store at {self.store_address}" if self.store_address else "the job's c10d store"
        if self.store_on_rank is not None and self.store_on_rank != self.rank:
            return LostRank(
                f"rank {self.store_on_rank} stopped responding ({where}, which it hosts, gave no answer for "
                f"{age:.0f} s) {self.phase}: stopping this rank",
                frozenset({self.store_on_rank}),
            )
        return LostRank(f"{where} stopped answering (for {age:.0f} s) {self.phase}: stopping this rank", frozenset())

    def _gone_here(self) -> set[int]:
        """Peers on this host whose process no longer exists (confirmed against a fresh read of their key)."""
        gone = {rank for rank in self.local_peers if self._state(rank) == "gone" and not self.table.finished(rank)}
        if gone:
            with contextlib.suppress(RuntimeError, OSError):  # a rank writes DONE before it exits
                for rank, value in self._read(sorted(gone)).items():
                    self.table.observe(rank, value, self.clock())
            gone = {rank for rank in gone if not self.table.finished(rank)}
        return gone

    def _state(self, rank: int) -> str:
        if rank not in self.identities:
            try:
                key = self.key(rank, "who")
                if not self.store.check([key]):
                    return "unknown"
                self.identities[rank] = ProcessIdentity.decode(self.store.get(key))
            except (RuntimeError, OSError, ValueError):
                return "unknown"
        return process_state(self.identities[rank], self.host)

    # -- a collective failed in the main thread --------------------------------------------------

    def explain(self, error: BaseException) -> LostRank | None:
        """The lost peer behind a collective that failed on a closed connection or timed out (gloo, after
        `ddp_timeout`); None for other errors.

        A peer on this host is looked up at once; one elsewhere is the peer whose heartbeat stops,
        which takes a few intervals to tell from a live one.
        """
        text = str(error).lower()
        closed = any(marker in text for marker in PEER_FAILURE_MARKERS)
        timed_out = any(marker in text for marker in COLLECTIVE_TIMEOUT_MARKERS)
        if not isinstance(error, RuntimeError) or not (closed or timed_out):
            return None
        how = "its connection closed" if closed else "a collective waiting for it timed out"
        deadline = self.clock() + (3.5 * self.interval if closed else 0.0)
        while True:
            with self._lock:
                gone = self._gone_here()
                exited = {rank for rank in self.peers if self.table.values[rank] == EXITED}
                silent = self.table.silent(self.clock(), 2.5 * self.interval)
            if gone:
                return died(gone, f"its process is gone; {how}", self.phase)
            if exited:
                return LostRank(
                    f"{name_ranks(exited)} stopped on its own error {self.phase} ({how}; the error is in its "
                    "output): stopping this rank",
                    frozenset(exited),
                )
            if silent:
                return died(silent, f"{how} and its heartbeat stopped", self.phase)
            if self.clock() >= deadline:
                break
            time.sleep(min(0.1, self.interval))
        if closed:
            return LostRank(
                f"a collective failed {self.phase} because another rank's connection closed, but every "
                "heartbeat is current, so which rank is unknown: stopping this rank",
                frozenset(),
            )
        return LostRank(
            f"a collective timed out {self.phase} (ddp_timeout) although every rank's heartbeat is current: a "
            "rank is alive but stuck outside the collective: stopping this rank",
            frozenset(),
        )

    # -- ending this rank ----------------------------------------------------------------------

    def speaker(self, lost: LostRank) -> int:
        """The rank that prints: the lowest one neither lost nor finished (every survivor agrees)."""
        with self._lock:
            finished = {rank for rank in self.peers if self.table.finished(rank)}
        alive = [rank for rank in range(self.world_size) if rank not in lost.culprits and rank not in finished]
        return min(alive, default=self.rank)

    def report(self, lost: LostRank) -> NoReturn:
        """Print the line (the speaker only), kill stopped culprits on this host, exit LOST_RANK_STATUS."""
        if not self._report_lock.acquire(blocking=False):
            while True:  # the other thread of this rank is already reporting and will exit the process
                time.sleep(1.0)
        self._stopping.set()
        if self.speaker(lost) == self.rank:
            with contextlib.suppress(Exception):
                close_progress_bars()  # the line must not land after an open bar
            # nor after the half-drawn bar of the rank that died (the ranks share the launcher's stderr)
            print(f"\nerror: {lost.message}", file=self.stream or sys.stderr, flush=True)
        else:
            # the speaker finds the same within an interval; leaving first would let the launcher
            # tear the job down before it prints
            time.sleep(2 * self.interval + 1.0)
        for rank in lost.culprits:
            if self._state(rank) == "stopped":
                with contextlib.suppress(OSError):
                    os.kill(self.identities[rank].pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        self._exit(LOST_RANK_STATUS)
        raise SystemExit(LOST_RANK_STATUS)  # only reached when `exit` is replaced (tests)


class PhaseCallback(TrainerCallback):
    """Keeps the watchdog's `phase` (`during step 37`) current, for the line it prints."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def on_step_begin(self, args, state, control, **kwargs):
        self.watchdog.phase = f"during step {state.global_step + 1}"

    def on_step_end(self, args, state, control, **kwargs):
        self.watchdog.phase = f"after step {state.global_step}"

    def on_train_end(self, args, state, control, **kwargs):
        self.watchdog.phase = "after training"


# -- the process-wide watchdog -----------------------------------------------------------------------


def job_store() -> tuple[Any, str, int | None]:
    """A store client of our own on the job's c10d store (so its timeout is ours), its address, and the
    rank hosting it (None when torchrun's agent hosts it, or when that cannot be told)."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if not isinstance(store, TCPStore):
        return _get_default_store(), "", None
    agent_hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    # (torch's stub does not declare Store.clone, which its C++ binding has)
    clone = store.clone()  # type: ignore[attr-defined]
    return clone, f"{store.host}:{store.port}", None if agent_hosted else 0


def node_ranks(rank: int) -> range | None:
    """The ranks of this node: torchrun numbers a node's LOCAL_WORLD_SIZE ranks consecutively."""
    try:
        local_rank, local_world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return range(rank - local_rank, rank - local_rank + local_world_size)


def start_watchdog(args: Any) -> list[TrainerCallback]:
    """Start this rank's watchdog when the run has several ranks and `args.rank_stall_timeout` > 0.

    Reading `args.world_size` sets up the process group (accelerate) if that has not happened yet.
    Returns the trainer callbacks that keep the watchdog's step current (none when it is off).
    """
    global _active
    timeout = float(getattr(args, "rank_stall_timeout", 0) or 0)
    if timeout <= 0 or args.world_size <= 1 or not torch.distributed.is_initialized():
        return []
    stop_watchdog()
    store, address, store_on_rank = job_store()
    interval = heartbeat_interval(timeout)
    with contextlib.suppress(AttributeError, RuntimeError):
        store.set_timeout(datetime.timedelta(seconds=max(1.0, min(2 * interval, timeout / 2))))
    namespace = f"dflash2_watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    rank = torch.distributed.get_rank()
    watchdog = Watchdog(
        store,
        rank,
        torch.distributed.get_world_size(),
        timeout,
        namespace=namespace,
        store_address=address,
        store_on_rank=store_on_rank,
        local_peers=node_ranks(rank),
    )
    watchdog.start()
    _active = watchdog
    return [PhaseCallback(watchdog)]


def finish_watchdog(how: bytes = DONE) -> None:
    """This rank is done (DONE) or stops on its own error (EXITED): stop watching, tell the others."""
    global _active
    watchdog, _active = _active, None
    if watchdog is not None:
        watchdog.finish(how)


def stop_watchdog() -> None:
    finish_watchdog(DONE)


@contextlib.contextmanager
def watched_run(debug: bool = False) -> Iterator[None]:
    """Around a script's `main`: a collective failed by a lost peer becomes one line and LOST_RANK_STATUS
    (never returns then); any other exception first tells the other ranks this one stops on its own."""
    try:
        yield
    except BaseException as error:
        watchdog = _active
        if watchdog is not None and not debug:
            lost = watchdog.explain(error)
            if lost is not None:
                watchdog.report(lost)
        finish_watchdog(EXITED)
        raise
    finish_watchdog(DONE)

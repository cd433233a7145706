"""Advisory folder locks: a run owns its output_dir, a writer owns the cache entry it is filling.

Two trainings on one output_dir would write checkpoints under the same step names; two
regenerations of one cache entry would ask every conversation twice and race on its journal. So
whoever writes takes an exclusive `fcntl.flock` on a lock file first and records who it is (pid,
host, job, start time) in it; a second writer is refused with one line naming the folder and the
holder.

Stale locks cannot happen: the kernel drops a flock when its holder exits, however it exits
(kill -9 included), so a lock file left behind by a dead run is simply taken over, and a live
holder's lock is never taken. The file itself stays (deleting it would let a late opener lock an
unlinked inode while a third process locks a new one).

One lock per job, not per rank: processes of one torchrun / accelerate launch share its
`TORCHELASTIC_RUN_ID` (else its MASTER_ADDR:MASTER_PORT). A cache entry held by another process of
the same job is waited for (that rank is filling it and the others will reuse it), never refused.

Shared filesystems: on Linux, flock on NFS (v4, or v3 with a lock manager) is carried out as a
POSIX byte-range lock by the server, so it holds across hosts; Lustre needs the `flock` mount
option (with `localflock` it is node-local); on FUSE object-store mounts (s3fs, gcsfuse) and other
filesystems without lock support it is at best node-local — put output_dir and the cache on a
filesystem that locks, or use one output_dir per job.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)

RUN_LOCK_NAME = ".dflash2-run.lock"
SAME_JOB_POLL_SECONDS = 0.5
SAME_JOB_WAIT_SECONDS = 24 * 3600.0  # a peer rank regenerating or capturing a large cache entry
# A holder's record is empty for a moment twice: between its flock and writing itself in, and between
# clearing it and unlocking. An empty record is read again for this long (from when it was first seen
# empty) before it counts as a stranger.
EMPTY_RECORD_GRACE_SECONDS = 2.0
EMPTY_RECORD_POLL_SECONDS = 0.02


class FolderInUseError(OSError):
    """Another run holds the folder (an OSError: the scripts print it in one line and exit 2)."""


def job_id() -> str | None:
    """What every process of one launch shares, or None for a process launched alone."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.environ["TORCHELASTIC_RUN_ID"]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("MASTER_ADDR"):
        return f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '')}"
    return None


def run_lock_file(output_dir: Path) -> Path:
    """A training run's lock: inside its output_dir (which the run creates and owns)."""
    return Path(output_dir) / RUN_LOCK_NAME


def entry_lock_file(entry: Path) -> Path:
    """A cache entry's lock: a sibling, since the entry itself appears only by one final rename."""
    entry = Path(entry)
    return entry.with_name(f".{entry.name}.lock")


def describe_holder(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process (it recorded no details)"
    started = holder.get("started")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {since}"


class FolderLock:
    """An exclusive advisory lock on `lock_file`, for the folder a run writes (`what` names it in
    messages: "output_dir", "regeneration cache entry", ...). Use as a context manager, or
    `acquire()` / `release()`."""

    def __init__(
        self,
        lock_file: Path,
        folder: Path,
        what: str,
        same_job_wait: float = SAME_JOB_WAIT_SECONDS,
        alternative: str = "",
    ):
        self.lock_file = Path(lock_file)
        self.alternative = alternative or f"choose another {what}"
        self.folder = Path(folder)
        self.what = what
        self.same_job_wait = same_job_wait
        self._descriptor: int | None = None

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    def holder(self) -> dict[str, Any]:
        """Who recorded themselves in the lock file (empty when unreadable)."""
        try:
            return json.loads(self.lock_file.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> FolderLock:
        if self.held:
            return self
        self.lock_file.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.same_job_wait
        empty_since: float | None = None  # when the holder's record was first read empty, in this stretch
        waited = False
        try:
            while True:
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as error:
                    if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                holder = self.holder()
                if holder:
                    empty_since = None
                else:
                    # the grace counts from when the record was seen empty: a waiter that has waited
                    # long already may poll while its holder is between clearing it and unlocking
                    now = time.monotonic()
                    empty_since = now if empty_since is None else empty_since
                    if now - empty_since < EMPTY_RECORD_GRACE_SECONDS:
                        time.sleep(EMPTY_RECORD_POLL_SECONDS)  # taking or releasing the lock: look again
                        continue
                mine = job_id()
                if mine is None or holder.get("job") != mine:
                    raise FolderInUseError(
                        f"{self.what} {self.folder} is in use by another run ({describe_holder(holder)}): "
                        f"wait for it to finish, or {self.alternative}"
                    )
                if time.monotonic() > deadline:
                    raise FolderInUseError(
                        f"{self.what} {self.folder} is still held by another process of this job "
                        f"({describe_holder(holder)}) after {self.same_job_wait:.0f} s"
                    )
                if not waited:
                    logger.info("%s %s is held by %s: waiting", self.what, self.folder, describe_holder(holder))
                    waited = True
                time.sleep(SAME_JOB_POLL_SECONDS)
            record = {"pid": os.getpid(), "host": socket.gethostname(), "job": job_id(), "started": time.time()}
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(descriptor)
        except BaseException:
            os.close(descriptor)
            raise
        self._descriptor = descriptor
        return self

    def release(self) -> None:
        if self._descriptor is None:
            return
        descriptor, self._descriptor = self._descriptor, None
        with contextlib.suppress(OSError):
            os.ftruncate(descriptor, 0)  # nobody holds it now; the next holder writes itself in
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        os.close(descriptor)

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()


def lock_run_folder(output_dir: Path) -> FolderLock:
    """The training run's lock on its output_dir (taken by one process of the job: rank 0)."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"output_dir {output_dir} is a file, not a folder: choose a folder for the run")
    return FolderLock(run_lock_file(output_dir), output_dir, "output_dir", same_job_wait=0.0)


def lock_cache_entry(entry: Path, what: str) -> FolderLock:
    """The lock of one cache entry being written (journal, feature store, converted target)."""
    return FolderLock(entry_lock_file(entry), Path(entry), what, alternative="give this run another cache_dir")

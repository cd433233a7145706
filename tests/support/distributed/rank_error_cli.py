"""Test-only: a user error on some ranks of a 2-process launch, through `trainer.commands.runner.run`.

Usage: torchrun --nproc_per_node 2 tests/support/distributed/rank_error_cli.py MODE
MODE `all`: every rank refuses the same value at once. MODE `rank1`: only rank 1 refuses; rank 0
keeps working (as a rank does that waits in a long step), so the launcher does not end the job.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from trainer.commands.runner import run

WORK_S = 60.0


def main(argv: list[str]) -> None:
    mode, rank = argv[0], int(os.environ["RANK"])
    if mode == "all":
        raise ValueError("learning_rate: -1 is below 0")
    if rank == 1:
        raise ValueError("dataset: shard 7 is missing on this host")
    time.sleep(WORK_S)


if __name__ == "__main__":
    run(main)

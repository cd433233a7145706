"""The terminal the commands share: a one-line message must not land after (or be redrawn over) a
progress bar still open, so the open bars are closed first. Its own module because both the error
convention (`trainer.cli`) and the lost-rank report (`trainer.training.watchdog`) print such lines."""

from __future__ import annotations


def close_progress_bars() -> None:
    """Close every open tqdm bar of this process (tqdm is imported only when a line is printed)."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()

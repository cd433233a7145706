"""The terminal the commands share: the flag and exit status of the one-line error convention, and
closing open progress bars so such a line does not land after (or get redrawn over) one. Its own
module, importing nothing heavy, because the torch-free dispatcher (`trainer.commands`), the error
convention (`trainer.cli`) and the lost-rank report (`trainer.training.watchdog`) all use it."""

from __future__ import annotations

DEBUG_FLAG = "--debug"  # anywhere on a command line: the traceback of a user error instead of its one line
USER_ERROR_STATUS = 2


def close_progress_bars() -> None:
    """Close every open tqdm bar of this process (tqdm is imported only when a line is printed)."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def worker_error_text(message: str) -> str:
    """The original one-line message of an error raised in a data-loader process: PyTorch re-raises it
    in the trainer as "Caught <Error> in DataLoader worker process N.\nOriginal Traceback ...:
    <Error>: <message>"; any other message is returned as it is."""
    if message.startswith("Caught ") and "\nOriginal Traceback" in message:
        last = message.rstrip().splitlines()[-1]
        name, separator, text = last.partition(": ")
        return text if separator and name.replace(".", "").replace("_", "").isalnum() else last
    return message

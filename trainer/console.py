"""The terminal the commands share: the flag and exit status of the one-line error convention, an
error's one line (`describe`), and closing open progress bars so such a line does not land after (or
get redrawn over) one. A leaf module, importing nothing heavy, apart from `trainer.commands` because
the libraries use it too: the lost-rank report (`trainer.training.watchdog`), the feature store's
worker errors and the rehearsal's check lines, none of which may import the commands."""

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


def describe(error: BaseException) -> str:
    """The message, or the exception's name when it has none (`FileNotFoundError` from a bare raise)."""
    message = worker_error_text(str(error)).strip()  # an error of a data-loader process: its own line
    if isinstance(error, OSError) and error.filename and str(error.filename) not in message:
        message = f"{message}: {error.filename}"
    return message or type(error).__name__

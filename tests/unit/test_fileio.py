"""trainer.fileio: local paths are told apart from Hub ids, and damaged safetensors files are named."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer.fileio import (
    check_checkpoint_weights,
    check_local_checkpoint,
    check_safetensors_file,
    looks_like_local_path,
    require_existing_path,
)


@pytest.mark.parametrize(
    "spec",
    [
        "/data/x",
        "./models/foo",
        "../foo",
        "~/models/foo",
        ".",
        "runs/my/target",
        "chat.jsonl",
        "data.json",
        "train.parquet",
        "model.gguf",
        "recipe.yaml",
        Path("target"),
    ],
)
def test_local_looking_specs(spec):
    assert looks_like_local_path(spec)


@pytest.mark.parametrize("spec", ["gpt2", "org/name", "Qwen/Qwen2.5-0.5B-Instruct", "hf://datasets/org/name/data"])
def test_hub_ids_are_not_local(spec):
    assert not looks_like_local_path(spec)


@pytest.mark.parametrize("spec", ["./models/foo", "/data/x", "runs/my/target"])
def test_missing_local_path_is_named(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as caught:
        require_existing_path(spec, "target")
    assert str(caught.value) == f"target: local path {spec} does not exist"


def test_existing_paths_and_hub_ids_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    assert require_existing_path("./models", "target") == "./models"
    assert require_existing_path("org/name", "target") == "org/name"  # left to the Hub
    monkeypatch.setenv("HOME", str(tmp_path))
    assert require_existing_path("~/models", "target") == str(tmp_path / "models")  # expanded for the loaders


def _save(path: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)} if tensors is None else tensors
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def test_whole_safetensors_pass(tmp_path):
    check_safetensors_file(_save(tmp_path / "model.safetensors"))
    check_safetensors_file(_save(tmp_path / "empty.safetensors", {}))


def test_truncated_safetensors_is_named(tmp_path):
    path = _save(tmp_path / "model.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ValueError) as caught:
        check_safetensors_file(path)
    assert str(caught.value) == f"{path} is truncated or corrupt: header says 40 bytes of tensor data, the file has 30"
    path.write_bytes(data + b"\0")  # trailing bytes: not the file the header describes either
    with pytest.raises(ValueError, match="header says 40 bytes of tensor data, the file has 41"):
        check_safetensors_file(path)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\x01\x02", "only 2 bytes, no room for the 8-byte header length"),
        (struct.pack("<Q", 1000) + b"{}", "it claims 1000 bytes, the file has 2 after it"),
        (struct.pack("<Q", 4) + b"nope", "not a JSON map of tensors to data_offsets"),
        (struct.pack("<Q", 17) + b'{"a": {"x": [0]}}', "not a JSON map of tensors to data_offsets"),
    ],
)
def test_corrupt_safetensors_header_is_named(tmp_path, content, reason):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError) as caught:
        check_safetensors_file(path)
    assert str(caught.value) == f"{path} is truncated or corrupt: header is not valid ({reason})"


class CountingReader:
    """A file handle that counts the bytes read through it."""

    def __init__(self, handle):
        self.handle, self.bytes_read = handle, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.handle.close()

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.bytes_read += len(data)
        return data


def test_the_check_reads_the_header_only(tmp_path, monkeypatch):
    path = _save(tmp_path / "model.safetensors", {"big": torch.zeros(1 << 20)})  # 4 MiB of data
    readers = []
    real_open = Path.open

    def counting_open(self, *args, **kwargs):
        readers.append(CountingReader(real_open(self, *args, **kwargs)))
        return readers[-1]

    monkeypatch.setattr(Path, "open", counting_open)
    check_safetensors_file(path)
    assert len(readers) == 1 and readers[0].bytes_read < 1024


def test_checkpoint_weights_check_every_shard(tmp_path):
    _save(tmp_path / "model-00001-of-00002.safetensors")
    shard = _save(tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    check_checkpoint_weights(tmp_path)
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(ValueError, match=re.escape(f"{shard} is truncated or corrupt")):
        check_checkpoint_weights(tmp_path)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{shard} is listed in")):
        check_checkpoint_weights(tmp_path)


def test_local_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="draft: local path /no/such/draft does not exist"):
        check_local_checkpoint("/no/such/draft", "draft")
    (tmp_path / "sub").mkdir()
    path = _save(tmp_path / "sub" / "model.safetensors")
    assert check_local_checkpoint(str(tmp_path), "draft") == str(tmp_path)  # no weights at the top
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        check_local_checkpoint(str(tmp_path), "draft", subfolder="sub")
    assert check_local_checkpoint("org/name", "draft") == "org/name"


def test_a_spec_that_can_only_be_local_is_checked_whatever_it_looks_like(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^checkpoint: local path checkpoint-3 does not exist$"):
        require_existing_path("checkpoint-3", "checkpoint", local_only=True)


def raw_safetensors(path: Path, header: dict, data_bytes: int) -> Path:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"\0" * data_bytes)
    return path


@pytest.mark.parametrize(
    ("header", "data_bytes", "problem"),
    [
        (
            {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}},
            20,
            "tensor a is F32 [2, 3] (24 bytes) but its data_offsets [0, 20] span 20 bytes",
        ),
        (
            {"a": {"dtype": "BF16", "shape": [2**62, 2**62], "data_offsets": [0, 16]}},
            16,
            f"tensor a is BF16 [{2**62}, {2**62}] ({2**125} bytes) but its data_offsets [0, 16] span 16 bytes",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            12,
            "tensor b has data_offsets [4, 12], but tensor a ends at 8",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
            },
            12,
            "tensor b has data_offsets [8, 12], but tensor a ends at 4",
        ),
        (
            {"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}},
            8,
            "tensor a has data_offsets [4, 8], but the data section begins at 0",
        ),
        (
            {"a": {"dtype": "F32", "shape": "two", "data_offsets": [0, 8]}},
            8,
            "header is not valid (tensor a has shape 'two')",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8]}},
            8,
            "header is not valid (not a JSON map of tensors to data_offsets)",
        ),
    ],
    ids=["size", "overflowing shape", "overlap", "gap", "late start", "shape", "float offset"],
)
def test_a_header_whose_shapes_disagree_with_its_offsets_is_named(tmp_path, header, data_bytes, problem):
    path = raw_safetensors(tmp_path / "model.safetensors", header, data_bytes)
    with pytest.raises(ValueError) as caught:
        check_safetensors_file(path)
    assert str(caught.value) == f"{path} is truncated or corrupt: {problem}"


def test_the_check_returns_the_tensor_entries(tmp_path):
    header = check_safetensors_file(
        _save(tmp_path / "model.safetensors", {"a": torch.zeros(2, 3, dtype=torch.bfloat16)})
    )
    assert header == {"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}}
    zero = {
        "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
    }
    check_safetensors_file(raw_safetensors(tmp_path / "zero.safetensors", zero, 4))  # empty tensors tile too


# -- replace_directory / remove_directory: the old folder is never lost ----------------------------------------


def _folder(path: Path, **files: str) -> Path:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _contents(path: Path) -> dict[str, str]:
    return {child.name: child.read_text() for child in sorted(path.iterdir())}


def test_replace_directory_swaps_the_new_folder_in_and_drops_the_old(tmp_path):
    from trainer.fileio import replace_directory

    old = _folder(tmp_path / "export", config="old", stale="only in the old one")
    new = _folder(tmp_path / ".export.new", config="new")
    replace_directory(new, old)
    assert _contents(old) == {"config": "new"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["export"]  # no aside copy left


def test_replace_directory_without_an_old_folder(tmp_path):
    from trainer.fileio import replace_directory

    replace_directory(_folder(tmp_path / "staged", a="1"), tmp_path / "final")
    assert _contents(tmp_path / "final") == {"a": "1"} and not (tmp_path / "staged").exists()


def test_a_failing_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    import trainer.fileio as fileio

    old = _folder(tmp_path / "checkpoint-4", weights="old")
    new = _folder(tmp_path / "staged", weights="new")
    real_replace, calls = fileio.os.replace, []

    def replace(source, destination):
        calls.append((Path(source).name, Path(destination).name))
        if Path(source) == new:
            raise OSError(28, "No space left on device")
        real_replace(source, destination)

    monkeypatch.setattr(fileio.os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        fileio.replace_directory(new, old, aside_prefix=".deleting-")
    assert _contents(old) == {"weights": "old"}  # under its own name again, whole
    assert _contents(new) == {"weights": "new"}  # left for the caller
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint-4", "staged"]
    assert calls[0][1].startswith(".deleting-checkpoint-4-") and calls[-1] == (calls[0][1], "checkpoint-4")


def test_a_failing_first_rename_changes_nothing(tmp_path, monkeypatch):
    import trainer.fileio as fileio

    old = _folder(tmp_path / "export", a="old")
    new = _folder(tmp_path / "new", a="new")

    def replace(source, destination):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fileio.os, "replace", replace)
    with pytest.raises(PermissionError):
        fileio.replace_directory(new, old)
    assert _contents(old) == {"a": "old"} and _contents(new) == {"a": "new"}


def test_remove_directory_renames_aside_before_deleting(tmp_path, monkeypatch):
    import trainer.fileio as fileio

    folder = _folder(tmp_path / "checkpoint-1", a="1")
    deleted = []
    real_rmtree = fileio.shutil.rmtree

    def rmtree(path, ignore_errors=False):
        deleted.append(Path(path).name)
        assert not folder.exists()  # never half-deleted under its own name
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(fileio.shutil, "rmtree", rmtree)
    fileio.remove_directory(folder, aside_prefix=".deleting-")
    assert not folder.exists() and list(tmp_path.iterdir()) == []
    assert len(deleted) == 1 and deleted[0].startswith(".deleting-checkpoint-1-")
    fileio.remove_directory(folder)  # already gone: nothing to do

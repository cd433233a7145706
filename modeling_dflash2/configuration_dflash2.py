# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dflash2-hub authors. Shipped inside every exported checkpoint under this licence.
"""Configuration of DFlash (v1) and DFlash2 draft models in the public z-lab layout.

Published drafts are `model_type: "qwen3"` configs whose DFlash fields live in a nested
`dflash_config` dict. `DFlash2Config` keeps that layout (it subclasses `Qwen3Config` and is never
registered under "qwen3"), validates every rule that can be checked from the config alone, and
exposes the resolved fields as properties.

`resolve_dflash_settings` does the same work for any config object, including a native
`Qwen3Config` (what `AutoConfig` returns when a checkpoint's `auto_map` names only `AutoModel`),
so the model never depends on which config class it was handed.

This file ships inside every checkpoint: it may import only torch, transformers and its sibling.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from transformers import Qwen3Config

logger = logging.getLogger(__name__)

DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
DFLASH_V1_ARCHITECTURE = "DFlashDraftModel"
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
DEFAULT_ROPE_THETA = 10_000.0

# Fields that only a DFlash2 draft has; all four are required for DFlash2 and forbidden for v1.
DFLASH2_REQUIRED_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Every field that belongs in `dflash_config`.
DFLASH_FIELDS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    *DFLASH2_REQUIRED_FIELDS,
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
    "attention_mode",
    "projector_type",
)

# The value rules that a draft config and the export contract (docs/contract.md) share, defined
# once here: `trainer.publishing.contract` and `trainer.models.config_bounds` read them, so a field
# has the same bound wherever it is checked. (What only the export refuses, e.g. an
# input_embedding_scale SGLang ignores, the trainer checks with the contract before training.)
MIN_BLOCK_SIZE = 2  # rule 6: the anchor plus at least one proposal
# rule 8: the selector re-ranks its top-k candidates; with one there is nothing to choose, and its
# sampling distribution would put all mass on the unary argmax.
MIN_SELECTOR_TOP_K = 2

_warned_rope_types: set[str] = set()


def selector_top_k_range(vocab_size: int) -> tuple[int, int]:
    """Rule 8's inclusive range of `selector_top_k`: at least 2 candidates, at most the vocabulary."""
    return MIN_SELECTOR_TOP_K, vocab_size


def is_positive_finite(value: Any) -> bool:
    """A real number (not a bool) that is finite and > 0: rule 11's output_multiplier."""
    return _is_number(value) and math.isfinite(value) and value > 0


def softcap_value(value: Any) -> float | None:
    """The soft-cap a stored `final_logit_softcapping` means: None when off (null or 0, as vLLM
    reads it), else a finite number > 0. Raises ValueError on anything else. An export
    writes only the `> 0` form and omits an off cap (rule 11)."""
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"final_logit_softcapping {value!r} must be a finite number > 0, or 0/null for off")
    return float(value) if value > 0 else None


@dataclass(frozen=True)
class DFlashSettings:
    """The resolved, validated DFlash fields of a draft config (one source of truth for the model)."""

    architecture: str
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    conv_kernel_size: int | None
    conv_group_size: int | None
    selector_rank: int | None
    selector_top_k: int | None
    output_multiplier: float
    final_logit_softcapping: float | None
    input_embedding_scale: float
    is_causal: bool | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope_theta: float

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == DFLASH2_ARCHITECTURE

    def layer_is_causal(self, layer_idx: int) -> bool:
        """Block-internal causality: an explicit `is_causal` applies to every layer; unset means
        sliding layers are causal and full-attention layers bidirectional (Reference and SGLang)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer_idx] == SLIDING_ATTENTION

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None


def _fail(field: str, rule: str, value: Any) -> None:
    raise ValueError(f"DFlash draft config: `{field}` {rule} (got {value!r}).")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_int(field: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if not _is_int(value):
        _fail(field, "must be an integer", value)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        _fail(field, f"must be {bound}", value)
    return value


def _require_positive_finite(field: str, value: Any) -> float:
    if not is_positive_finite(value):
        _fail(field, "must be a finite number > 0", value)
    return float(value)


def _attributes(config: Any) -> dict[str, Any]:
    """Instance attributes only, so a property of the same name never shadows a stored value."""
    return vars(config)


def _dflash_dict(config: Any) -> dict[str, Any]:
    dfc = _attributes(config).get("dflash_config")
    if dfc is None:
        _fail(
            "dflash_config",
            "is required: a dict holding at least block_size, mask_token_id and target_layer_ids",
            dfc,
        )
    if not isinstance(dfc, dict):
        _fail("dflash_config", "must be a dict", dfc)
    return dfc


def _dflash_value(config: Any, name: str, default: Any = None) -> Any:
    """`dflash_config` first, then a top-level attribute: how the Reference reads every field."""
    dfc = _dflash_dict(config)
    if name in dfc:
        return dfc[name]
    return _attributes(config).get(name, default)


def _resolve_architecture(config: Any) -> str:
    return draft_architecture({**_attributes(config), "dflash_config": _dflash_dict(config)})


def draft_architecture(values: dict[str, Any]) -> str:
    """DFlash2 or DFlash v1, from a config's fields (a config.json or a config's attributes):
    `architectures`, else whether `dflash_config` carries a DFlash2 field."""
    architectures = values.get("architectures")
    if architectures is None:
        dfc = values.get("dflash_config")
        has_v2 = isinstance(dfc, dict) and any(name in dfc for name in DFLASH2_REQUIRED_FIELDS)
        return DFLASH2_ARCHITECTURE if has_v2 else DFLASH_V1_ARCHITECTURE
    if isinstance(architectures, (list, tuple)) and list(architectures) == [DFLASH2_ARCHITECTURE]:
        return DFLASH2_ARCHITECTURE
    if isinstance(architectures, (list, tuple)) and list(architectures) == [DFLASH_V1_ARCHITECTURE]:
        return DFLASH_V1_ARCHITECTURE
    _fail(
        "architectures",
        f'must be exactly ["{DFLASH2_ARCHITECTURE}"] (or ["{DFLASH_V1_ARCHITECTURE}"] for a DFlash v1 draft)',
        architectures,
    )
    raise AssertionError  # unreachable, keeps type checkers happy


def _resolve_block_size(config: Any) -> int:
    dfc = _dflash_dict(config)
    top = _attributes(config).get("block_size")
    nested = dfc.get("block_size")
    if top is not None and nested is not None and top != nested:
        _fail(
            "block_size",
            f"is given both at top level ({top!r}) and in dflash_config and the two must be equal",
            nested,
        )
    value = nested if nested is not None else top
    if value is None:
        _fail("dflash_config.block_size", "is required (the trained block size)", value)
    return _require_int("dflash_config.block_size", value, minimum=MIN_BLOCK_SIZE)


def _resolve_rope_theta(config: Any) -> float:
    attrs = _attributes(config)
    rope_parameters = attrs.get("rope_parameters") or {}
    if not isinstance(rope_parameters, dict):
        _fail("rope_parameters", "must be a dict with rope_theta and rope_type", rope_parameters)
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type != "default" and rope_type not in _warned_rope_types:
        _warned_rope_types.add(rope_type)
        logger.warning(
            "DFlash draft config: rope_parameters.rope_type=%r is not 'default'; the draft applies only "
            "the RoPE base (rope_theta) and ignores the scaling of this type.",
            rope_type,
        )
    theta = attrs.get("rope_theta")
    if theta is None:
        theta = rope_parameters.get("rope_theta", DEFAULT_ROPE_THETA)
    return _require_positive_finite("rope_theta", theta)


def _check_target_layer_ids(ids: Any, num_target_layers: int | None) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)) or len(ids) == 0:
        _fail("dflash_config.target_layer_ids", "must be a non-empty list of integers", ids)
    upper = None if num_target_layers is None else num_target_layers - 1
    for layer_id in ids:
        if not _is_int(layer_id):
            _fail("dflash_config.target_layer_ids", "must contain only integers", ids)
        if layer_id < 0 or (upper is not None and layer_id > upper):
            _fail(
                "dflash_config.target_layer_ids",
                f"entries must be in [0, num_target_layers={num_target_layers})",
                ids,
            )
    return tuple(ids)


def _check_attention_layout(config: Any) -> tuple[tuple[str, ...], int | None]:
    attrs = _attributes(config)
    num_layers = _require_int("num_hidden_layers", attrs.get("num_hidden_layers"), minimum=1)
    layer_types = attrs.get("layer_types")
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        _fail("layer_types", f"must have exactly one entry per layer (num_hidden_layers={num_layers})", layer_types)
    for layer_type in layer_types:
        if layer_type not in (FULL_ATTENTION, SLIDING_ATTENTION):
            _fail("layer_types", f"entries must be '{FULL_ATTENTION}' or '{SLIDING_ATTENTION}'", layer_types)
    sliding_window = attrs.get("sliding_window")
    if SLIDING_ATTENTION in layer_types:
        if sliding_window is None:
            _fail(
                "sliding_window",
                "must be an integer >= 1 when a layer is sliding_attention "
                "(Qwen3Config drops it unless use_sliding_window is true)",
                sliding_window,
            )
        _require_int("sliding_window", sliding_window, minimum=1)
    else:
        sliding_window = None
    return tuple(layer_types), sliding_window


def _check_backbone(config: Any) -> None:
    attrs = _attributes(config)
    if getattr(config, "model_type", None) != "qwen3":
        _fail(
            "model_type", 'must be "qwen3" (the public DFlash checkpoint contract)', getattr(config, "model_type", None)
        )
    if attrs.get("hidden_act") != "silu":
        _fail("hidden_act", 'must be "silu" (SGLang raises on anything else)', attrs.get("hidden_act"))
    if attrs.get("attention_bias"):
        _fail("attention_bias", "must be false (published drafts have no attention bias)", attrs.get("attention_bias"))
    if attrs.get("attention_dropout", 0.0) != 0:
        _fail("attention_dropout", "must be 0", attrs.get("attention_dropout"))
    hidden = _require_int("hidden_size", attrs.get("hidden_size"), minimum=1)
    heads = _require_int("num_attention_heads", attrs.get("num_attention_heads"), minimum=1)
    kv_heads = _require_int("num_key_value_heads", attrs.get("num_key_value_heads"), minimum=1)
    if heads % kv_heads != 0:
        _fail("num_key_value_heads", f"must divide num_attention_heads={heads}", kv_heads)
    head_dim = attrs.get("head_dim")
    if head_dim is not None:
        _require_int("head_dim", head_dim, minimum=2)
        if head_dim % 2:
            _fail("head_dim", "must be even (rotate-half RoPE)", head_dim)
    vocab = _require_int("vocab_size", attrs.get("vocab_size"), minimum=1)
    partial = attrs.get("partial_rotary_factor")
    rope_parameters = attrs.get("rope_parameters") or {}
    if isinstance(rope_parameters, dict):
        partial = rope_parameters.get("partial_rotary_factor", partial)
    if partial is not None and partial != 1.0:
        _fail(
            "partial_rotary_factor",
            "must be absent: the draft applies full rotary (never inherit it from a target)",
            partial,
        )
    draft_vocab = attrs.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != vocab:
        _fail(
            "draft_vocab_size",
            f"must equal vocab_size={vocab}: DFlash2 codebooks need the full target vocab",
            draft_vocab,
        )
    target_hidden = attrs.get("target_hidden_size")
    if target_hidden is not None and target_hidden != hidden:
        _fail(
            "target_hidden_size",
            f"must equal hidden_size={hidden}: the draft runs at the target's width",
            target_hidden,
        )
    if attrs.get("eagle_aux_hidden_state_layer_ids") is not None:
        _fail(
            "eagle_aux_hidden_state_layer_ids",
            "must not be set: vLLM would tap those layers without the +1 shift; use dflash_config.target_layer_ids",
            attrs.get("eagle_aux_hidden_state_layer_ids"),
        )
    is_causal = attrs.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        _fail("is_causal", "must be true, false or null", is_causal)


def resolve_dflash_settings(config: Any) -> DFlashSettings:
    """Validate `config` against every rule checkable from the config alone and resolve its fields.

    Works on `DFlash2Config` and on a plain `Qwen3Config` carrying a `dflash_config` attribute.
    Raises `ValueError` naming the field and the rule on the first violation.
    """
    _check_backbone(config)
    attrs = _attributes(config)
    dfc = _dflash_dict(config)
    architecture = _resolve_architecture(config)
    block_size = _resolve_block_size(config)
    vocab = attrs["vocab_size"]
    hidden = attrs["hidden_size"]

    mask_token_id = _dflash_value(config, "mask_token_id")
    if mask_token_id is None:
        _fail("dflash_config.mask_token_id", "is required (a target embedding row the draft is trained with)", None)
    _require_int("dflash_config.mask_token_id", mask_token_id, minimum=0, maximum=vocab - 1)

    num_target_layers = attrs.get("num_target_layers")
    if num_target_layers is not None:
        _require_int("num_target_layers", num_target_layers, minimum=1)
    elif architecture == DFLASH2_ARCHITECTURE:
        _fail("num_target_layers", "is required for DFlash2 (the target's decoder depth)", None)
    target_layer_ids = _check_target_layer_ids(_dflash_value(config, "target_layer_ids"), num_target_layers)

    conv_kernel_size = conv_group_size = selector_rank = selector_top_k = None
    if architecture == DFLASH2_ARCHITECTURE:
        for name in DFLASH2_REQUIRED_FIELDS:
            if name not in dfc:
                _fail(f"dflash_config.{name}", "is required for DFlash2 (never defaulted)", None)
        conv_kernel_size = _require_int("dflash_config.conv_kernel_size", dfc["conv_kernel_size"], 1, block_size)
        conv_group_size = _require_int("dflash_config.conv_group_size", dfc["conv_group_size"], minimum=1)
        if hidden % conv_group_size:
            _fail("dflash_config.conv_group_size", f"must divide hidden_size={hidden}", conv_group_size)
        selector_rank = _require_int("dflash_config.selector_rank", dfc["selector_rank"], minimum=1)
        low, high = selector_top_k_range(vocab)
        selector_top_k = dfc["selector_top_k"]
        if not _is_int(selector_top_k) or not low <= selector_top_k <= high:
            _fail(
                "dflash_config.selector_top_k",
                f"must be an integer in [{low}, vocab_size={high}] (docs/contract.md rule 8: the selector "
                f"chooses among its top-k candidates)",
                selector_top_k,
            )
    else:
        present = [name for name in DFLASH2_REQUIRED_FIELDS if _dflash_value(config, name) is not None]
        if present:
            _fail(
                "architectures",
                f"is DFlashDraftModel (v1) but the config carries DFlash2 fields {present}; "
                f'use ["{DFLASH2_ARCHITECTURE}"]',
                attrs.get("architectures"),
            )

    output_multiplier = _require_positive_finite(
        "dflash_config.output_multiplier", _dflash_value(config, "output_multiplier", 1.0)
    )
    softcap = _dflash_value(config, "final_logit_softcapping")
    try:
        softcap = softcap_value(softcap)
    except ValueError:
        _fail("dflash_config.final_logit_softcapping", "must be a finite number >= 0 (0 or null = off)", softcap)
    input_embedding_scale = _require_positive_finite(
        "dflash_config.input_embedding_scale", _dflash_value(config, "input_embedding_scale", 1.0)
    )
    attention_mode = _dflash_value(config, "attention_mode")
    if attention_mode not in (None, "gqa", "mha"):
        _fail("dflash_config.attention_mode", "must be 'gqa', 'mha' or absent", attention_mode)
    projector_type = _dflash_value(config, "projector_type")
    if projector_type not in (None, "dflash"):
        _fail("dflash_config.projector_type", "must be 'dflash' or absent", projector_type)

    layer_types, sliding_window = _check_attention_layout(config)
    return DFlashSettings(
        architecture=architecture,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids,
        num_target_layers=num_target_layers,
        conv_kernel_size=conv_kernel_size,
        conv_group_size=conv_group_size,
        selector_rank=selector_rank,
        selector_top_k=selector_top_k,
        output_multiplier=output_multiplier,
        final_logit_softcapping=softcap,
        input_embedding_scale=input_embedding_scale,
        is_causal=attrs.get("is_causal"),
        layer_types=layer_types,
        sliding_window=sliding_window,
        rope_theta=_resolve_rope_theta(config),
    )


class DFlash2Config(Qwen3Config):
    r"""Config of a DFlash2 (or DFlash v1) draft, serialised in the public z-lab layout.

    Args (beyond `Qwen3Config`):
        dflash_config (`dict`): block_size, mask_token_id, target_layer_ids and, for DFlash2,
            conv_kernel_size, conv_group_size, selector_rank, selector_top_k; optional
            output_multiplier (1.0), final_logit_softcapping (null/0 = off), input_embedding_scale (1.0).
            A DFlash field given at top level is moved here (a conflicting duplicate is an error);
            a DFlash v1 `block_size` stays at top level, where v1 loaders read it.
        is_causal (`bool`, *optional*): block-internal causality for every layer; unset means
            sliding layers causal and full-attention layers bidirectional.
        num_target_layers (`int`): decoder depth of the target (`target_num_hidden_layers` is
            accepted and renamed).

    RoPE base: top-level `rope_theta` if given, else `rope_parameters.rope_theta`, else 10000; the
    resolved base is written back into `rope_parameters` so the saved file is unambiguous.
    """

    dflash_config: dict | None = None
    is_causal: bool | None = None
    num_target_layers: int | None = None

    def __post_init__(self, **kwargs):
        top_rope_theta = kwargs.pop("rope_theta", None)
        kwargs = self._absorb_legacy_dflash_fields(kwargs)
        super().__post_init__(**kwargs)
        self._apply_rope_theta(top_rope_theta)
        # Validate now: a bad config must fail where it is built, not deep inside a forward pass.
        resolve_dflash_settings(self)

    def _absorb_legacy_dflash_fields(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Move top-level DFlash fields into `dflash_config`; keep a v1 top-level `block_size`."""
        self.dflash_config = dict(self.dflash_config) if self.dflash_config is not None else None
        legacy_depth = kwargs.pop("target_num_hidden_layers", None)
        if legacy_depth is not None:
            if self.num_target_layers is not None and self.num_target_layers != legacy_depth:
                _fail(
                    "num_target_layers",
                    f"disagrees with target_num_hidden_layers={legacy_depth}",
                    self.num_target_layers,
                )
            self.num_target_layers = legacy_depth
        top_level = {name: kwargs.pop(name) for name in DFLASH_FIELDS if name in kwargs}
        top_level = {name: value for name, value in top_level.items() if value is not None}
        if not top_level:
            return kwargs
        if self.dflash_config is None:
            self.dflash_config = {}
        is_v1 = self.architectures is not None and list(self.architectures) == [DFLASH_V1_ARCHITECTURE]
        for name, value in top_level.items():
            nested = self.dflash_config.get(name)
            if nested is not None and nested != value:
                _fail(
                    name,
                    f"is given both at top level ({value!r}) and in dflash_config and the two must be equal",
                    nested,
                )
            if name == "block_size" and is_v1:
                self.__dict__["block_size"] = value
            else:
                self.dflash_config[name] = value
        return kwargs

    def _apply_rope_theta(self, top_rope_theta: float | None) -> None:
        rope_parameters = dict(self.rope_parameters or {})
        nested = rope_parameters.get("rope_theta")
        if top_rope_theta is not None and nested is not None and nested != top_rope_theta:
            logger.warning(
                "DFlash draft config: top-level rope_theta=%s overrides rope_parameters.rope_theta=%s.",
                top_rope_theta,
                nested,
            )
        theta = top_rope_theta if top_rope_theta is not None else nested
        rope_parameters["rope_theta"] = float(theta if theta is not None else DEFAULT_ROPE_THETA)
        rope_parameters.setdefault("rope_type", "default")
        self.rope_parameters = rope_parameters

    @property
    def dflash_settings(self) -> DFlashSettings:
        return resolve_dflash_settings(self)

    @property
    def is_dflash2(self) -> bool:
        return self.dflash_settings.is_dflash2

    @property
    def block_size(self) -> int:
        return self.dflash_settings.block_size

    @property
    def mask_token_id(self) -> int:
        return self.dflash_settings.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_settings.target_layer_ids)

    @property
    def conv_kernel_size(self) -> int | None:
        return self.dflash_settings.conv_kernel_size

    @property
    def conv_group_size(self) -> int | None:
        return self.dflash_settings.conv_group_size

    @property
    def selector_rank(self) -> int | None:
        return self.dflash_settings.selector_rank

    @property
    def selector_top_k(self) -> int | None:
        return self.dflash_settings.selector_top_k

    @property
    def output_multiplier(self) -> float:
        return self.dflash_settings.output_multiplier

    @property
    def final_logit_softcapping(self) -> float | None:
        """The soft-cap in use, or None when off (a stored 0 means off)."""
        return self.dflash_settings.final_logit_softcapping

    @property
    def input_embedding_scale(self) -> float:
        return self.dflash_settings.input_embedding_scale

    @property
    def rope_base(self) -> float:
        """The RoPE theta the draft applies (not named `rope_theta`: transformers reads that name)."""
        return self.dflash_settings.rope_theta

    def layer_is_causal(self, layer_idx: int) -> bool:
        return self.dflash_settings.layer_is_causal(layer_idx)


DFlash2Config.register_for_auto_class()

__all__ = [
    "MIN_BLOCK_SIZE",
    "MIN_SELECTOR_TOP_K",
    "DFlash2Config",
    "DFlashSettings",
    "draft_architecture",
    "is_positive_finite",
    "resolve_dflash_settings",
    "selector_top_k_range",
    "softcap_value",
]

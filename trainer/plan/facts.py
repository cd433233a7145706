"""What the planner knows before any GPU is rented: the two models' shapes and exact parameter
counts (built on the meta device from their config.json files; no weight is loaded), and the run's
precision, sharding and shapes from the recipe and, optionally, an accelerate config.

Precision and draft sharding come from the recipe (`bf16`/`fp16`, `fsdp` + `fsdp_config`) or from
an accelerate config (what `accelerate launch --config_file` would apply: `mixed_precision`,
`distributed_type: FSDP`, `fsdp_config`, `num_processes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from modeling_dflash2 import DFlash2Config, DFlash2DraftModel, DFlashDraftModel
from modeling_dflash2.modeling_dflash2 import DFlash2CandidateSelector, DFlash2DecoderLayer
from trainer.data.online_features import streams_engine_features
from trainer.fileio import default_cache_root, require_existing_path
from trainer.models import pairing
from trainer.models.pairing import TargetDimensions
from trainer.models.target import PYPI_PREFIX, TargetSource
from trainer.recipe_files import read_recipe, resolve_path

GIB = 2**30
FP32 = 4
# CUDA context and kernels (~0.5-1 GiB), NCCL communicators and their buffers, and the caching
# allocator's slack: memory the process holds that no tensor accounts for. Fixed, not modelled;
# on CPU (planning the validation runs) the process's own baseline is not planned: 0.
OTHER_BYTES = {"cuda": 2 * GIB, "cpu": 0}
DEVICES = tuple(OTHER_BYTES)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    sliding_window: bool = False  # some layer attends through a window (its masks cost more to build)

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
    embedding_parameters: int = 0
    head_parameters: int = 0  # 0 when the LM head is the embedding tensor (tie_word_embeddings)

    @property
    def whole_parameters(self) -> int:
        """Parameters outside the decoder layers (embedding, final norm, LM head): never sharded."""
        return self.parameters - self.layer_parameters

    @property
    def head_only_parameters(self) -> int:
        """What a run with streamed features loads (`TargetHead`): the input embedding and the LM head."""
        return self.embedding_parameters + self.head_parameters


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
    packing: bool = False  # packed rows: documents end to end, each with its own anchor quota
    gradient_accumulation: int = 1
    feature_servers: int = 0  # vLLM servers the features are streamed from while training; 0: not streamed
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def streams_features(self) -> bool:
        """Features streamed from `feature_endpoint` (`offline: false`): the target is its embedding and
        LM head only, and nothing is captured here."""
        return self.feature_servers > 0

    @property
    def block_slots(self) -> int:
        """Block slots per row: `num_anchors` for rows of one document; for packed rows the worst
        case over the documents a row can hold (`packed_block_slots`)."""
        return packed_block_slots(self.max_length, self.num_anchors) if self.packing else self.num_anchors


def packed_block_slots(max_length: int, num_anchors: int) -> int:
    """The most block slots a packed row of `max_length` tokens can get (docs/planning.md, "Packed rows").

    Each document gets min(N, its valid anchors) slots, and a document of l tokens has at most l - 1
    valid anchors, so k documents get at most min(k*N, L - k): k*N grows and L - k shrinks with k,
    so the maximum lies at k = floor(L / (N + 1)) or the next k. It is reached (rows of k fully
    supervised documents of near-equal length), so it is the bound, not an estimate. At least 1,
    as `sample_anchors` gives a row with no valid anchor one dummy slot."""
    if max_length < 1 or num_anchors < 1:
        raise ValueError(f"max_length={max_length}, num_anchors={num_anchors}: both must be >= 1")
    crossing = max_length // (num_anchors + 1)
    candidates = [k for k in (crossing, crossing + 1) if 1 <= k <= max_length]
    return max(1, *(min(k * num_anchors, max_length - k) for k in candidates))


# ---------------------------------------------------------------------------------------------
# Reading the configs and counting parameters on the meta device
# ---------------------------------------------------------------------------------------------


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
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
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
        embedding_parameters=embedding.numel(),
        head_parameters=0 if head is embedding else head.numel(),
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
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,  # None: one per head
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
        sliding_window=any(window is not None for _, window in rules),
    )


def check_pair(draft: DraftFacts, target: TargetFacts, target_name: str = "") -> None:
    """The draft must fit the target: the one pair check training and export make
    (`trainer.models.pairing`), each failure naming the field."""
    pairing.check_pair(
        hidden_size=draft.hidden_size,
        vocab_size=draft.vocab_size,
        target_layer_ids=draft.target_layer_ids,
        num_target_layers=draft.num_target_layers,
        target=TargetDimensions(target_name, target.hidden_size, target.vocab_size, target.num_layers),
    )


# ---------------------------------------------------------------------------------------------
# Precision and sharding, from the recipe and (optionally) an accelerate config
# ---------------------------------------------------------------------------------------------


def read_accelerate_config(path: str) -> dict[str, Any]:
    """An accelerate config file (`accelerate launch --config_file`) as a mapping, read like a recipe
    (`read_recipe`: no aliases or duplicate keys, every problem naming the file and line)."""
    return read_recipe(resolve_path(path, "--accelerate-config"), "--accelerate-config")


# what `accelerate launch` puts in each process's environment for its FSDP settings, by the
# accelerate config key it comes from
_LAUNCH_FSDP_VARIABLES = {
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_sharding_strategy": "FSDP_SHARDING_STRATEGY",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
}


def launched_accelerate_config(environ: Mapping[str, str]) -> dict[str, Any]:
    """The accelerate config this process was launched with, from the environment `accelerate
    launch` sets, in the shape `read_accelerate_config` returns: a training run plans its own
    sharding (TrainingArguments reads ACCELERATE_MIXED_PRECISION itself, but not FSDP). Empty when
    not launched with FSDP."""
    if environ.get("ACCELERATE_USE_FSDP", "").strip().lower() not in ("1", "true", "yes"):
        return {}
    fsdp = {key: environ[name] for key, name in _LAUNCH_FSDP_VARIABLES.items() if environ.get(name)}
    return {"distributed_type": "FSDP", "fsdp_config": fsdp}


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
    servers = len(data_args.feature_endpoint) if streams_engine_features(data_args) else 0
    if servers and model_args.target_sharding == "fsdp":  # what TargetHead.place refuses
        raise ValueError(
            "target_sharding: fsdp: there are no decoder layers to shard with streamed features "
            "(feature_endpoint with offline: false); set target_sharding: none"
        )
    target_sharded = model_args.target_sharding == "fsdp" and num_gpus > 1
    objective = training_args.objective_config()
    if servers:
        target = "embedding + LM head only (features streamed from feature_endpoint)"
        features = f"streamed from {servers} vLLM server{'s' if servers > 1 else ''} (feature_endpoint)"
    else:
        target = "decoder layers sharded (fsdp)" if target_sharded else "whole"
        features = "offline (from disk)" if data_args.offline else "online (target forward each step)"
    settings = {
        "precision": precision.name,
        "draft": _draft_layout(draft_fsdp, reshard, offload, num_gpus),
        "target": f"{model_args.target_dtype}, {target}",
        "activation checkpointing": "on" if checkpointing else "off",
        "attention": model_args.attn_implementation,
        "features": features,
        "objective": f"{objective.loss_type}, kd_weight {objective.resolved_kd_weight:g}",
    }
    packing = data_args.packing
    if packing:
        slots = packed_block_slots(data_args.max_length, objective.num_anchors)
        settings["packing"] = f"true (worst case {slots} block slots per row, {objective.num_anchors} unpacked)"
    else:
        settings["packing"] = f"false ({objective.num_anchors} block slots per row)"
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
        packing=packing,
        gradient_accumulation=training_args.gradient_accumulation_steps,
        feature_servers=servers,
    )

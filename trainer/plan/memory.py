"""Per-rank memory of a training run by part, from the planner's facts (pure arithmetic; docs/planning.md
derives every formula). In short, per rank:

    per_rank = target_weights + draft_weights + draft_gradients + optimizer_states
               + activations + loss_head + other

With features streamed from vLLM servers, target_weights is the embedding and LM head alone and the
plan also gives the feature bytes that cross the network per optimizer step
(`streamed_feature_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.objective.config import selector_chunk_blocks
from trainer.plan.facts import (
    FP32,
    GIB,
    OTHER_BYTES,
    DraftFacts,
    RunFacts,
    TargetFacts,
    check_pair,
    draft_facts,
    load_target_config,
    run_facts,
    target_facts,
)
from trainer.publishing.draft_gate import load_draft_config

PARTS = (
    "target_weights",
    "draft_weights",
    "draft_gradients",
    "optimizer_states",
    "activations",
    "loss_head",
    "other",
)
MAX_MICRO_BATCH = 4096


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
    held_target_parameters: int | None = None  # streamed features: the embedding and LM head only
    streamed_feature_bytes: int | None = None  # streamed features: bytes over the network per optimizer step
    streamed_feature_formula: str = ""
    length_terms: dict[str, int] = field(default_factory=dict)  # what the context length costs, by term
    shape: dict[str, int] = field(default_factory=dict)  # S, N, T, K of one row
    peak_phase: str = "step"  # where the activations peak: step, capture or mask_build
    capture_line: str = ""  # whether the target's capture fits one rank, and what takes over if not
    max_num_anchors: int | None = None  # the most anchor slots one row fits with (unpacked rows only)

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
            **(
                {"streamed_feature_bytes_per_step": self.streamed_feature_bytes}
                if self.streamed_feature_bytes is not None
                else {}
            ),
            "shape": dict(self.shape),
            "peak_phase": self.peak_phase,
            "length_terms": {name: int(value) for name, value in self.length_terms.items()},
            "capture": self.capture_line,
            "max_num_anchors": self.max_num_anchors,
        }

    def describe(self) -> str:
        """A human-readable table."""
        lines = [f"{key}: {value}" for key, value in self.settings.items()]
        if self.streamed_feature_bytes is not None:
            lines.append(
                f"features over the network per optimizer step: {self.streamed_feature_bytes / GIB:.2f} GiB "
                f"({self.streamed_feature_formula})"
            )
        target = f"{self.target_parameters:,}"
        if self.held_target_parameters is not None:
            target += f" (loaded: {self.held_target_parameters:,}, the embedding and LM head)"
        lines += [
            f"target parameters: {target}   draft parameters: {self.draft_parameters:,}",
            f"per rank, micro-batch {self.micro_batch}:",
        ]
        lines += [f"  {name:<18}{self.parts[name] / GIB:>9.2f} GiB" for name in PARTS]
        lines.append(f"  {'total':<18}{self.per_rank_bytes / GIB:>9.2f} GiB")
        if self.length_terms:
            shape = self.shape
            lines.append(
                f"at {shape['context']} tokens ({shape['block_slots']} block slots, {shape['draft_tokens']} draft "
                f"tokens, {shape['keys']} keys a row), micro-batch {self.micro_batch}, peak at the {self.peak_phase}:"
            )
            lines += [f"  {LENGTH_TERMS[name]:<44}{value / GIB:>9.2f} GiB" for name, value in self.length_terms.items()]
        if self.capture_line:
            lines.append(self.capture_line)
        lines += self._verdict_lines()
        return "\n".join(lines)

    def _verdict_lines(self) -> list[str]:
        verdict = "fits" if self.fits else "does NOT fit"
        lines = [
            f"{verdict} on {self.num_gpus} x {self.gpu_memory_bytes / GIB:.1f} GiB",
            f"largest per_device_train_batch_size that fits: {self.max_micro_batch}",
        ]
        if not self.fits and self.max_num_anchors is not None:
            lines.append(f"largest num_anchors with which one row fits: {self.max_num_anchors}")
        return lines

    def verdict(self) -> str:
        """The plan in one line: the total, its largest part and the table's two verdict lines (what a
        run refused before it starts prints, `trainer.plan.fit_check`)."""
        largest = max(PARTS, key=lambda name: self.parts[name])
        total = f"{self.per_rank_bytes / GIB:.2f} GiB per rank at micro-batch {self.micro_batch}"
        part = f"{largest} {self.parts[largest] / GIB:.2f} GiB"
        return f"{total} (largest part: {part}) " + "; ".join(self._verdict_lines())


# ---------------------------------------------------------------------------------------------
# The memory model
# ---------------------------------------------------------------------------------------------


def _per_rank(count: int, world: int) -> int:
    return math.ceil(count / world)


def target_weight_bytes(target: TargetFacts, run: RunFacts) -> int:
    """Whole on every rank, or (target_sharding fsdp) embedding + final norm + LM head whole and the
    decoder layers 1/world; the layer being all-gathered during capture is counted there. With
    features streamed from vLLM servers, the embedding and LM head alone (`TargetHead`: no layer,
    no final norm; a tied head is the embedding)."""
    if run.streams_features:
        return target.head_only_parameters * run.target_bytes
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
    """Per-row element counts of one micro-batch row: N block slots (`num_anchors`, or a packed
    row's worst case), T = N*B draft tokens, S context tokens, K = S + T keys."""

    rows: int
    context: int
    blocks: int
    tokens: int

    @property
    def keys(self) -> int:
        return self.context + self.tokens


def step_shape(draft: DraftFacts, run: RunFacts, micro_batch: int) -> StepShape:
    """The context is max_length whether packed (rows are filled up to it) or not (a batch of
    full-length samples, the case the plan is for)."""
    blocks = run.block_slots
    return StepShape(rows=micro_batch, context=run.max_length, blocks=blocks, tokens=blocks * draft.block_size)


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


# Bytes per [T, K] element of building one visibility rule's mask, measured on CPU with torch 2.13
# (the same code runs on CUDA): flex_attention's `create_block_mask` evaluates the rule over the whole
# grid (vmap) before it compresses it into 128 x 128 blocks; sdpa's dense mask is the same rule
# broadcast, kept as one boolean per element. A sliding window adds an int64 difference.
MASK_BUILD_BYTES = {
    ("flex_attention", False): 10,
    ("flex_attention", True): 11,
    ("dense", False): 5,
    ("dense", True): 11,
}


def mask_build_bytes(draft: DraftFacts, run: RunFacts, shape: StepShape) -> int:
    """Per row, the peak of building the attention masks (after the capture, before the draft's
    forward): the rule evaluated over the whole [T, K] grid, one rule at a time (sdpa keeps each
    finished dense mask; a finished BlockMask is a few MB), beside the features the step already
    holds (as captured or loaded and the trainer's fp32 copy; fc's 16-bit copy does not exist yet).
    At long context with many anchors this is the step's peak: T x K grows as N x (S + N x B)."""
    flex = run.attention == "flex_attention"
    per_element = MASK_BUILD_BYTES[("flex_attention" if flex else "dense", draft.sliding_window)]
    finished = 0 if flex else (draft.mask_rules - 1) * shape.tokens * shape.keys
    source = run.feature_bytes
    features = (source + (FP32 if source != FP32 else 0)) * shape.context * draft.hidden_size
    features *= draft.num_features + (1 if run.distills else 0)
    return per_element * shape.tokens * shape.keys + finished + features


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
    blocks = shape.rows * shape.blocks
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
        step = selector_chunk_blocks(run.chunk_blocks, v, draft.selector_rank, top_k)
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
    the all-gathered current and prefetched layers. Nothing with offline or streamed features: the
    target does not run here (streamed features arrive as the server sends them, in target_dtype,
    and are counted with the step's features)."""
    if not run.online or run.streams_features:
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


def streamed_feature_bytes(draft: DraftFacts, target: TargetFacts, run: RunFacts) -> int:
    """Bytes of target features that cross the network in one optimizer step when they are streamed
    from vLLM servers (`feature_endpoint`, `offline: false`): every micro-batch of every rank,

        micro_batch x max_length x layers x hidden_size x target_dtype bytes
                    x gradient_accumulation_steps x world_size

    with `layers` = len(set(target_layer_ids)), the layers the server extracts (vLLM's ids are
    sorted and de-duplicated; the client repeats a duplicate), each token's hidden states in the
    server's dtype, target_dtype. A bound at full-length rows, the plan's case (a shorter sample
    sends only its own tokens); the token ids and file headers beside the features (8 bytes a token,
    against layers x hidden x 2) are not counted, nor evaluation steps. 0 when not streamed."""
    if not run.streams_features:
        return 0
    layers = len(set(draft.target_layer_ids))
    per_micro_batch = run.micro_batch * run.max_length * layers * target.hidden_size * run.target_bytes
    return per_micro_batch * run.gradient_accumulation * run.world_size


def streamed_feature_formula(draft: DraftFacts, target: TargetFacts, run: RunFacts) -> str:
    """`streamed_feature_bytes`'s factors, as the plan prints them."""
    return (
        f"{run.micro_batch} rows x {run.max_length} tokens x {len(set(draft.target_layer_ids))} layers x "
        f"{target.hidden_size} x {run.target_bytes} bytes, x {run.gradient_accumulation} micro-batches "
        f"x {run.world_size} ranks"
    )


def dynamic_parts(draft: DraftFacts, target: TargetFacts, run: RunFacts, micro_batch: int) -> tuple[int, int]:
    """(activations, loss_head) for one micro-batch.

    The step peaks either at the end of forward (everything kept for backward, the tensors forward
    still holds, and the loss head) or early in backward (what is kept, plus backward's working
    set), whichever is higher; the online capture and the masks' build run before the step and
    count if their own peak is higher. activations = peak - loss_head, so the two parts sum to the
    peak."""
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
    peak = max(step, capture_bytes(draft, target, run, shape), shape.rows * mask_build_bytes(draft, run, shape))
    loss_head = head_kept + head_transient
    return peak - loss_head, loss_head


LENGTH_TERMS = {
    "capture": "target capture (no grad, before the step)",
    "features": "captured layers, their copies (+ final)",
    "context_kv": "draft context k/v of length S (kept layers)",
    "layers_kept": "decoder layers kept for backward",
    "mask_build": "attention masks' build (transient)",
    "dense_masks": "dense masks kept through forward",
    "loss_head": "chunked LM-head loss",
}


def length_terms(draft: DraftFacts, target: TargetFacts, run: RunFacts, micro_batch: int) -> tuple[dict, str]:
    """({term: bytes for the micro-batch}, the phase where the activations peak): what the context
    length costs, term by term (docs/planning.md, "What each part costs at long context").
    `context_kv` is the part of every kept layer that grows with S (the k_proj/v_proj input over
    [context; block], k_norm's fp32 values, k and v): with activation checkpointing one layer at a
    time holds it (the one recomputed in backward) and each layer keeps only its s·T·H input."""
    shape = step_shape(draft, run, micro_batch)
    no_context = dataclasses.replace(shape, context=0)
    context_per_layer = layer_kept_bytes(draft, run, shape) - layer_kept_bytes(draft, run, no_context)
    layers = 1 if run.activation_checkpointing else draft.num_layers
    if run.activation_checkpointing:
        kept = draft.num_layers * run.precision.stream * shape.tokens * draft.hidden_size
    else:
        kept = draft.num_layers * layer_kept_bytes(draft, run, shape)
    head_kept, head_transient = loss_head_bytes(draft, run, shape)
    flex = run.attention == "flex_attention"
    per_element = MASK_BUILD_BYTES[("flex_attention" if flex else "dense", draft.sliding_window)]
    terms = {
        "capture": capture_bytes(draft, target, run, shape),
        "features": shape.rows * feature_bytes_per_row(draft, run, shape),
        "context_kv": shape.rows * layers * context_per_layer,
        "layers_kept": shape.rows * kept,
        "mask_build": shape.rows * per_element * shape.tokens * shape.keys,
        "dense_masks": 0 if flex else shape.rows * draft.mask_rules * shape.tokens * shape.keys,
        "loss_head": head_kept + head_transient,
    }
    activations, loss_head = dynamic_parts(draft, target, run, micro_batch)
    peak = activations + loss_head
    phase = "step"
    if peak == shape.rows * mask_build_bytes(draft, run, shape):
        phase = "mask_build"
    if peak == terms["capture"] and terms["capture"]:
        phase = "capture"
    return terms, phase


def capture_line(draft: DraftFacts, target: TargetFacts, run: RunFacts, gpu_memory_bytes: int) -> str:
    """One line: whether the target's capture of one full-length row fits in one rank beside the
    target's weights, and if not, which mechanism takes over (docs/planning.md, "When the capture
    does not fit one rank")."""
    if run.streams_features:
        return "capture: none here; the vLLM servers run the target (tensor parallel on the serving side)"
    if not run.online:
        return "capture: none here (offline features, captured once by `dflash2 prepare`)"
    row = dataclasses.replace(run, micro_batch=1)
    shape = step_shape(draft, row, 1)
    capture = capture_bytes(draft, target, row, shape)
    other = OTHER_BYTES[run.device]
    sharded = dataclasses.replace(row, target_sharded=True)
    whole = capture + target_weight_bytes(target, row) + other
    split = capture_bytes(draft, target, sharded, shape) + target_weight_bytes(target, sharded) + other
    said = f"capture of one {run.max_length}-token row: {capture / GIB:.2f} GiB"
    if whole <= gpu_memory_bytes or (run.target_sharded and split <= gpu_memory_bytes):
        held = "sharded" if run.target_sharded else "whole"
        weights = target_weight_bytes(target, row)
        return f"{said} beside {weights / GIB:.2f} GiB of target weights ({held}): fits in one rank"
    if not run.target_sharded and run.world_size > 1 and split <= gpu_memory_bytes:
        return (
            f"{said}: does not fit one rank beside the whole target; set target_sharding: fsdp ({split / GIB:.2f} GiB)"
        )
    return (
        f"{said}: does not fit one rank even with the target sharded; stream the features from vLLM "
        "with tensor parallelism on the serving side (feature_endpoint with offline: false, docs/scale.md); "
        "this project has no context parallelism"
    )


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
    terms, phase = length_terms(draft, target, run, run.micro_batch)
    shape = step_shape(draft, run, run.micro_batch)
    return MemoryPlan(
        parts=memory_parts(draft, target, run, run.micro_batch),
        num_gpus=run.world_size,
        gpu_memory_bytes=gpu_memory_bytes,
        target_parameters=target.parameters,
        draft_parameters=draft.parameters,
        max_micro_batch=largest_micro_batch(draft, target, run, gpu_memory_bytes),
        micro_batch=run.micro_batch,
        settings=run.settings,
        held_target_parameters=target.head_only_parameters if run.streams_features else None,
        streamed_feature_bytes=streamed_feature_bytes(draft, target, run) if run.streams_features else None,
        streamed_feature_formula=streamed_feature_formula(draft, target, run) if run.streams_features else "",
        length_terms=terms,
        shape={"context": shape.context, "block_slots": shape.blocks, "draft_tokens": shape.tokens, "keys": shape.keys},
        peak_phase=phase,
        capture_line=capture_line(draft, target, run, gpu_memory_bytes),
        max_num_anchors=None if run.packing else fitting_anchors(draft, target, run, gpu_memory_bytes, run.num_anchors),
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
    draft = draft_facts(load_draft_config(model_args, building=False))  # configs only: nothing is built
    target = target_facts(load_target_config(model_args, cache_root))
    check_pair(draft, target, model_args.target)
    run = run_facts(model_args, data_args, training_args, num_gpus, accelerate, device)
    if run.streams_features:  # what a vLLM server cannot return is refused here as training refuses it
        from trainer.data.engine_features import check_engine_layers

        check_engine_layers(draft.target_layer_ids, target.num_layers, run.distills)
    return plan_memory(draft, target, run, gpu_memory_bytes)


def fitting_anchors(draft: DraftFacts, target: TargetFacts, run: RunFacts, gpu_memory_bytes: int, wanted: int) -> int:
    """The most anchor slots, at most `wanted`, with which one micro-batch row fits (0 if even one
    slot does not): every part grows with the slots, so a bisection finds it."""

    def fits(anchors: int) -> bool:
        candidate = dataclasses.replace(run, num_anchors=anchors, micro_batch=1)
        return sum(memory_parts(draft, target, candidate, 1).values()) <= gpu_memory_bytes

    if not fits(1):
        return 0
    low, high = 1, wanted + 1
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low

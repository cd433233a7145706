"""CUDA-only checks (run by `make gpu-check`; every test skips without a CUDA device).

- flex_attention (BlockMask) == sdpa with the dense bool masks, forward and gradients, fp32 and
  bf16, on a draft with a full and a sliding-window layer and dummy block slots;
- one bf16 autocast training step against the fp32 step;
- FSDP2 (one rank, NCCL): a step, then DCP sharded and full state dicts loaded into plain models;
- greedy speculative decoding on CUDA is exactly the target's greedy decoding, and a flex_attention
  draft decodes exactly as the same weights under sdpa.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from benchmarks.setups import StepSetup, SyntheticBatch, synthetic_batch
from benchmarks.train_step import optimized_step
from modeling_dflash2 import DFlash2Config, DFlash2DraftModel
from tests.support.drafts import randomize, tiny_config, tiny_dflash_config
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from tests.unit.evaluation.test_speculative import OracleProposals
from trainer.evaluation.speculative import spec_generate, target_generate
from trainer.objective.blocks import AnchorDraw, BlockBatch, build_blocks, sample_anchors
from trainer.objective.config import ObjectiveConfig
from trainer.objective.loss import embed_draft_ids
from trainer.objective.masks import attention_masks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
# flex_attention's CUDA kernels need a head dimension of at least 16 (the CPU tests use 8).
HEAD_DIM = 16
HYBRID = {"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True, "sliding_window": 3}


@pytest.fixture(autouse=True)
def _ieee_fp32_matmuls() -> Iterator[None]:
    """fp32 comparisons are only tight without TF32; restore whatever the session had."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def cuda_config(attention: str = "sdpa", **overrides: Any) -> DFlash2Config:
    """The conftest tiny config with flex-sized heads; a new object each call (the config carries
    the attention backend, so two models must never share one)."""
    config = tiny_config(head_dim=HEAD_DIM, **overrides)
    config._attn_implementation = attention
    return config


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return float((actual.float() - expected).norm() / expected.norm().clamp(min=1e-12))


# ---------------------------------------------------------------------------------------------
# flex_attention == dense masks
# ---------------------------------------------------------------------------------------------


def packed_blocks(config: DFlash2Config) -> BlockBatch:
    """Two rows of 20 tokens, 4 block slots each; the second row has only two valid anchors, so
    two of its slots are dummies (rows that see only themselves)."""
    loss_mask = torch.zeros(2, 20, dtype=torch.long)
    loss_mask[0, 4:] = 1
    loss_mask[1, 4:7] = 1
    input_ids = torch.randint(4, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    input_ids, loss_mask = input_ids.to(DEVICE), loss_mask.to(DEVICE)
    anchors, keep = sample_anchors(loss_mask, 4, AnchorDraw(seed=0, step=0))
    return build_blocks(input_ids, loss_mask, anchors, keep, config.block_size, config.mask_token_id)


def forward_backward(
    attention: str, dtype: torch.dtype, blocks: BlockBatch, layers: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Output and every gradient (inputs and parameters) of one draft forward with a fixed random
    upstream gradient; the weights depend only on the seed, not on the backend."""
    model = randomize(DFlash2DraftModel(cuda_config(attention, **layers)), seed=0)
    model = model.to(DEVICE, dtype).train()
    config = model.config
    generator = torch.Generator().manual_seed(1)
    queries = blocks.draft_ids.shape[1]
    width = len(config.target_layer_ids) * config.hidden_size
    noise = torch.randn(2, queries, config.hidden_size, generator=generator).to(DEVICE, dtype).requires_grad_()
    features = torch.randn(2, blocks.context_length, width, generator=generator).to(DEVICE, dtype).requires_grad_()
    upstream = torch.randn(2, queries, config.hidden_size, generator=generator).to(DEVICE, dtype)
    masks = attention_masks(blocks, model.dflash, attention)
    expected_mask = "BlockMask" if attention == "flex_attention" else "Tensor"
    assert {type(mask).__name__ for mask in masks.values()} == {expected_mask}
    output = model(
        position_ids=blocks.model_position_ids(), noise_embedding=noise, target_hidden=features, attention_mask=masks
    )
    output.backward(upstream)
    results = {"output": output.detach(), "grad:noise": noise.grad, "grad:features": features.grad}
    # the selector is not part of the forward; every other parameter is
    used = [(name, p) for name, p in model.named_parameters() if not name.startswith("candidate_selector.")]
    results.update({f"grad:{name}": p.grad for name, p in used})
    return results


def hybrid_blocks() -> BlockBatch:
    config = cuda_config(**HYBRID)
    assert config.dflash_settings.layer_sliding_window(1) == 3  # the second layer really slides
    blocks = packed_blocks(config)
    assert (~blocks.keep).sum() == 2 and blocks.keep[0].all()
    return blocks


def check_exercised(results: dict[str, torch.Tensor]) -> None:
    for name, tensor in results.items():
        assert tensor is not None and torch.isfinite(tensor).all(), name
        assert tensor.float().norm() > 0, name  # every gradient is exercised


def test_flex_attention_equals_dense_masks_in_fp32():
    blocks = hybrid_blocks()
    dense = forward_backward("sdpa", torch.float32, blocks, HYBRID)
    flex = forward_backward("flex_attention", torch.float32, blocks, HYBRID)
    assert dense.keys() == flex.keys()
    check_exercised(flex)
    for name, expected in dense.items():
        error = relative_error(flex[name], expected)
        assert error <= 5e-5, f"{name}: relative error {error:.2e}"
    torch.testing.assert_close(flex["output"], dense["output"], rtol=1e-4, atol=1e-5)


def test_flex_attention_in_bf16_is_as_accurate_as_dense_masks():
    """Two bf16 paths differ by bf16 rounding (~1-2% here), so each is measured against the fp32
    dense result: flex may not be much worse than dense (a wrong mask is off by tens of percent)."""
    blocks = hybrid_blocks()
    exact = forward_backward("sdpa", torch.float32, blocks, HYBRID)
    dense = forward_backward("sdpa", torch.bfloat16, blocks, HYBRID)
    flex = forward_backward("flex_attention", torch.bfloat16, blocks, HYBRID)
    assert exact.keys() == dense.keys() == flex.keys()
    check_exercised(flex)
    for name, expected in exact.items():
        flex_error, dense_error = relative_error(flex[name], expected), relative_error(dense[name], expected)
        assert flex_error <= max(2 * dense_error, 1e-2) and flex_error <= 5e-2, (name, flex_error, dense_error)


def test_flex_attention_equals_dense_masks_on_packed_rows():
    """Packed rows (documents of 8 + 12 and 6 + 6 + 8 tokens): the flex BlockMask keeps each block to
    its own document exactly as the dense mask does (which tests/unit/data/test_packing.py checks against
    each document alone on CPU)."""
    config = cuda_config(**HYBRID)
    positions = torch.tensor([[*range(8), *range(12)], [*range(6), *range(6), *range(8)]], device=DEVICE)
    loss_mask = torch.ones(2, 20, dtype=torch.long, device=DEVICE)
    loss_mask[:, :2] = 0
    input_ids = torch.randint(4, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    anchors, keep = sample_anchors(loss_mask, 2, AnchorDraw(seed=0, step=0), position_ids=positions)
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, config.block_size, config.mask_token_id, positions)
    assert blocks.starts.unique().tolist() == [0, 6, 8, 12]
    dense = forward_backward("sdpa", torch.float32, blocks, HYBRID)
    flex = forward_backward("flex_attention", torch.float32, blocks, HYBRID)
    check_exercised(flex)
    for name, expected in dense.items():
        error = relative_error(flex[name], expected)
        assert error <= 5e-5, f"{name}: relative error {error:.2e}"


def test_the_sliding_layer_changes_the_result():
    """Control: without the window the outputs differ, so the comparison above covers the window."""
    config = cuda_config(**HYBRID)
    blocks = packed_blocks(config)
    windowed = forward_backward("sdpa", torch.float32, blocks, HYBRID)["output"]
    full = {**HYBRID, "sliding_window": 64}
    unwindowed = forward_backward("sdpa", torch.float32, blocks, full)["output"]
    assert relative_error(windowed, unwindowed) > 1e-3


# ---------------------------------------------------------------------------------------------
# bf16 autocast training step
# ---------------------------------------------------------------------------------------------


def cuda_setup(attention: str = "sdpa") -> StepSetup:
    """A benchmark-style step on the CUDA-sized tiny config (a selector wide enough that gold
    tokens are often candidates, so its parameters receive gradients)."""
    config = cuda_config(attention, dflash_config=tiny_dflash_config(selector_top_k=24))
    return StepSetup("cuda-tiny", config, rows=2, length=24, anchors=6, prompt_length=4, chunk_blocks=2)


def objective_config(setup: StepSetup) -> ObjectiveConfig:
    return ObjectiveConfig(num_anchors=setup.anchors, chunk_blocks=setup.chunk_blocks)


def stepped_draft(setup: StepSetup, batch: SyntheticBatch, autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradients) of one trainer step (draft forward, `draft_objective`, backward)."""
    draft = randomize(DFlash2DraftModel(setup.config), seed=3, scale=0.1).to(DEVICE).train()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = optimized_step(draft, batch, objective_config(setup))
    return float(loss), {name: p.grad for name, p in draft.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
def test_bf16_autocast_training_step_matches_fp32(attention):
    batch = synthetic_batch(cuda_setup(), DEVICE)
    reference_loss, reference = stepped_draft(cuda_setup("sdpa"), batch, autocast=False)
    loss, gradients = stepped_draft(cuda_setup(attention), batch, autocast=True)
    assert gradients.keys() == reference.keys()
    assert math.isfinite(loss) and math.isfinite(reference_loss)
    assert abs(loss - reference_loss) <= 3e-2 * abs(reference_loss), (loss, reference_loss)
    for name, gradient in gradients.items():
        assert gradient is not None, f"{name} got no gradient"
        assert gradient.dtype == torch.float32 and torch.isfinite(gradient).all(), name
    flat = torch.cat([g.flatten() for g in gradients.values()])
    flat_reference = torch.cat([g.flatten() for g in reference.values()])
    cosine = torch.nn.functional.cosine_similarity(flat, flat_reference, dim=0)
    assert cosine > 0.98, f"bf16 gradient direction differs from fp32 (cosine {cosine:.4f})"


# ---------------------------------------------------------------------------------------------
# FSDP2 on one rank: save and load
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def nccl_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-rank NCCL process group, destroyed however the test ends."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group is already initialised"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def block_hidden(model: DFlash2DraftModel, batch: SyntheticBatch) -> torch.Tensor:
    """The draft's output on the batch's blocks (no objective), in eval mode."""
    blocks = batch.blocks
    model.eval()
    with torch.no_grad():
        return model(
            position_ids=blocks.model_position_ids(),
            noise_embedding=embed_draft_ids(batch.embedding, blocks.draft_ids, model.dflash.input_embedding_scale),
            target_hidden=batch.target_hidden,
            attention_mask=attention_masks(blocks, model.dflash),
        )


def plain_draft(setup: StepSetup, seed: int) -> DFlash2DraftModel:
    return randomize(DFlash2DraftModel(setup.config), seed=seed, scale=0.1).to(DEVICE)


def test_fsdp2_step_then_sharded_and_full_state_dicts_load_into_plain_models(nccl_group, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    setup = cuda_setup()
    batch = synthetic_batch(setup, DEVICE)
    sharded = plain_draft(setup, seed=0).train()
    initial = {name: tensor.detach().clone() for name, tensor in sharded.state_dict().items()}
    mesh = init_device_mesh(DEVICE, (1,))
    for layer in sharded.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    assert all(isinstance(parameter, DTensor) for parameter in sharded.parameters())
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    loss = optimized_step(sharded, batch, objective_config(setup))
    assert torch.isfinite(loss)
    optimizer.step()
    expected = block_hidden(sharded, batch)

    dcp.save(get_model_state_dict(sharded), checkpoint_id=str(tmp_path / "dcp"))
    full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert full.keys() == initial.keys()
    assert not any(isinstance(tensor, DTensor) for tensor in full.values())
    changed = [name for name in full if not torch.equal(full[name].to(DEVICE), initial[name])]
    assert len(changed) == len(full), "the optimizer step must have moved every parameter"

    from_dcp = plain_draft(setup, seed=1)
    state = from_dcp.state_dict()
    assert not torch.equal(state["fc.weight"].cpu(), full["fc.weight"])  # the load below has work to do
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    from_dcp.load_state_dict(state)
    from_full = plain_draft(setup, seed=2)
    from_full.load_state_dict(full)
    for name, tensor in from_full.state_dict().items():
        assert torch.equal(tensor, from_dcp.state_dict()[name]), name
    for model in (from_dcp, from_full):
        torch.testing.assert_close(block_hidden(model, batch), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Lossless speculative decoding on CUDA
# ---------------------------------------------------------------------------------------------

PROMPTS = [[1, 9, 14, 22, 7], [1, 30, 31], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 40]]
NEW_TOKENS = 20


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def cuda_pair(request) -> tuple[torch.nn.Module, DFlash2DraftModel]:
    """The CPU test's pair (peaked target, random draft), on the GPU in fp32."""
    target = tiny_target(request.param, seed=1)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(20)
    draft = randomize(DFlash2DraftModel(tiny_draft_config_for(target)), seed=2, scale=0.2)
    return target.model.to(DEVICE), draft.to(DEVICE)


def stop_ids(model: torch.nn.Module) -> list[int]:
    """What `generate` stops on by default, so both sides stop at the same token."""
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def greedy_generate(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt], device=DEVICE)
    output = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return output[0, len(prompt) :].tolist()


def smallest_margin(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> float:
    """Smallest top-1 minus top-2 logit along the greedy path: a near-tie there would make the
    comparison depend on kernel rounding rather than on the decoding logic."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]], device=DEVICE)).logits[0, len(prompt) - 1 :]
    top = logits.float().topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


@pytest.mark.parametrize("use_selector", [True, False])
def test_greedy_speculative_decoding_on_cuda_equals_target_greedy(cuda_pair, use_selector):
    target, draft = cuda_pair
    stops = stop_ids(target)
    for prompt in PROMPTS:
        reference = greedy_generate(target, prompt, NEW_TOKENS)
        assert smallest_margin(target, prompt, reference) > 1e-3
        result = spec_generate(
            target,
            draft,
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            stop_token_ids=stops,
            use_selector=use_selector,
        )
        assert result.tokens == reference
        assert sum(result.acceptance_lengths) == len(reference) - 1
        assert all(1 <= n <= draft.block_size for n in result.acceptance_lengths)


def test_partial_acceptance_on_cuda_keeps_caches_exact(cuda_pair, monkeypatch):
    """Every step accepts exactly two proposals, so cache cropping runs at every step."""
    target, draft = cuda_pair
    prompt = PROMPTS[0]
    greedy = target_generate(target, torch.tensor([prompt]), max_new_tokens=40).tokens
    monkeypatch.setattr(draft, "block_proposals", OracleProposals(greedy, wrong=2))  # proposes on hidden.device
    result = spec_generate(target, draft, torch.tensor([prompt]), max_new_tokens=25)
    assert result.tokens == greedy[:25]
    assert result.acceptance_lengths[:-1] == [3] * (len(result.acceptance_lengths) - 1)


def test_flex_attention_decoding_on_cuda_equals_sdpa():
    """Decoding with a flex draft hands flex BlockMasks converted from the draft's bool masks (the
    CPU tests run torch's unfused flex; here CUDA's compiled kernel): same tokens and acceptance
    lengths as the same weights under sdpa, on a full and a sliding-window layer."""
    target = tiny_target("qwen3", seed=1)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(20)
    config = tiny_draft_config_for(target, head_dim=HEAD_DIM, num_hidden_layers=2, **HYBRID)
    sdpa = randomize(DFlash2DraftModel(config), seed=2, scale=0.2).to(DEVICE)
    flex_config = DFlash2Config.from_dict(config.to_dict())
    flex_config._attn_implementation = "flex_attention"
    flex = DFlash2DraftModel(flex_config).to(DEVICE)
    flex.load_state_dict(sdpa.state_dict())
    model = target.model.to(DEVICE)
    for prompt in PROMPTS:
        expected = spec_generate(model, sdpa, torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
        result = spec_generate(model, flex, torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
        assert result.tokens == expected.tokens
        assert result.acceptance_lengths == expected.acceptance_lengths

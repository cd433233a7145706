"""flex_attention on CPU, as far as torch 2.13 allows: forward (evaluation, decoding), never training.

- The draft's flex forward equals its sdpa forward with the dense masks on ordinary, packed and
  sliding-window rows at lengths that are not multiples of flex's 128-token blocks (CPU flex runs
  torch's unfused implementation, see `unfused_flex_forward`); the BlockMasks' tile tables, which
  only CUDA's kernel walks, equal the dense masks' tiles; controls show both checks would see a
  mask that forgets documents or windows.
- Decoding (serve-time masks from positions, with a cache) with flex equals sdpa token for token,
  on a draft loaded with `AutoModel.from_pretrained(..., attn_implementation="flex_attention")`.
- Training with flex on CPU is refused: by the draft when a forward needs gradients, and by
  `dflash2 train` in one line before the target loads (torch has no CPU backward for flex).

Measured here: flex - sdpa <= 1.1e-6 on every row below; the tolerance is 1e-5 (fp32 values of order 1).
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import AutoModel

from modeling_dflash2 import DFlash2DraftModel
from tests.support.distributed.tiny_setup import write_tiny_run
from tests.support.drafts import draft_inputs, randomize, tiny_draft
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.commands import train
from trainer.commands.runner import run
from trainer.evaluation.speculative import spec_generate
from trainer.models import draft as draft_module
from trainer.models.draft import FLEX_ON_CPU, check_attention_for_training, flex_forward_gap
from trainer.models.target import FrozenTarget
from trainer.objective.blocks import build_blocks, sample_anchors
from trainer.objective.masks import attention_masks, flex_attention_available, flex_block_mask

pytestmark = pytest.mark.skipif(not flex_attention_available(), reason="flex_attention not in this torch")

TOLERANCE = 1e-5
# a full-attention and a sliding-window layer (window 3), bidirectional or causal inside the block
HYBRID = {"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True, "sliding_window": 3}
LAYERS = {"bidirectional": {**HYBRID, "is_causal": False}, "causal": {**HYBRID, "is_causal": True}}


def objective_inputs(kind: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(collated batch with target features, target embedding) at tiny_config's sizes; lengths are
    not multiples of 128 (23; 29 packed; 150, past one flex block)."""
    generator = torch.Generator().manual_seed(seed)
    length = {"ordinary": 23, "packed": 29, "long": 150}[kind]
    batch: dict[str, torch.Tensor] = {
        "input_ids": torch.randint(4, 50, (2, length), generator=generator),
        "loss_mask": torch.ones(2, length, dtype=torch.long),
        "target_hidden": torch.randn(2, length, 64, generator=generator),
    }
    batch["loss_mask"][:, :2] = 0
    batch["loss_mask"][1, -3:] = 0  # row 1 has fewer valid anchors: its last block slots are dummies
    if kind == "packed":  # documents of 11 + 18 and 6 + 9 + 14 tokens, positions restarting at 0
        batch["position_ids"] = torch.tensor(
            [[*range(11), *range(18)], [*range(6), *range(9), *range(14)]], dtype=torch.long
        )
    return batch, torch.randn(50, 32, generator=generator)


@pytest.mark.parametrize("layers", LAYERS)
@pytest.mark.parametrize("kind", ["ordinary", "packed", "long"])
def test_flex_forward_equals_dense_masks(kind, layers):
    draft = tiny_draft(seed=3, **LAYERS[layers]).eval()
    batch, embedding = objective_inputs(kind)
    anchors = 24 if kind == "long" else None  # long: 24 anchors per row, kv = 150 + 96
    gap = flex_forward_gap(draft, batch, embedding, anchors)
    assert gap <= TOLERANCE, f"{kind}/{layers}: flex - sdpa = {gap:.2e}"
    assert draft.config._attn_implementation == "sdpa"  # restored


def careless_masks(blocks, settings, backend: str) -> dict[str, Any]:
    """flex masks that forget document starts and sliding windows (dense masks stay right)."""
    if backend != "flex_attention":
        return attention_masks(blocks, settings, backend)
    mask = flex_block_mask(dataclasses.replace(blocks, starts=None), causal=False, sliding_window=None)
    return dict.fromkeys(settings.layer_types, mask)


@pytest.mark.parametrize("layers", LAYERS)
def test_flex_block_tables_list_exactly_the_tiles_the_dense_masks_use(layers):
    """CPU flex runs unfused and reads only the mask rule; the block tables that CUDA's kernel
    walks are checked here instead: a 128 x 128 tile is listed iff the dense mask sees into it.
    Packed rows of 600 tokens, an anchor at every valid position: each query tile holds 32
    neighbouring blocks, so windows and document starts leave tiles out (the careless mask's
    tables differ)."""
    settings = tiny_draft(seed=3, **LAYERS[layers]).dflash
    input_ids = torch.randint(4, 50, (2, 600), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(input_ids)
    positions = torch.tensor([[*range(250), *range(350)], [*range(420), *range(180)]])
    anchors, keep = sample_anchors(loss_mask, 600, position_ids=positions)
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, settings.block_size, 3, positions)
    dense, flex = attention_masks(blocks, settings, "sdpa"), attention_masks(blocks, settings, "flex_attention")
    careless = careless_masks(blocks, settings, "flex_attention")
    for layer_type, block_mask in flex.items():
        visible = dense[layer_type][:, 0]
        rows, cols = visible.shape[-2:]
        tiles = F.pad(visible, (0, -cols % 128, 0, -rows % 128)).unflatten(1, (-1, 128)).unflatten(-1, (-1, 128))
        used = tiles.any(dim=(2, 4))
        assert torch.equal(block_mask.to_dense()[:, 0].bool(), used), layer_type
        assert not torch.equal(careless[layer_type].to_dense()[:, 0].bool(), used), layer_type


@pytest.mark.parametrize(
    ("kind", "layers"), [("packed", {}), ("ordinary", LAYERS["causal"])], ids=["packed", "sliding"]
)
def test_the_comparison_sees_a_mask_that_forgets_documents_or_windows(kind, layers, monkeypatch):
    """Control: on packed rows and sliding layers the masks decide the output, so the gap above
    would show a flex mask that got documents or windows wrong."""
    monkeypatch.setattr(draft_module, "attention_masks", careless_masks)
    draft = tiny_draft(seed=3, **layers).eval()
    batch, embedding = objective_inputs(kind)
    assert flex_forward_gap(draft, batch, embedding) > 1e-2


def test_compiled_cpu_flex_equals_eager_flex_and_sdpa_at_lengths_off_the_128_grid():
    """The old refusal said compiled CPU flex is wrong at lengths not a multiple of 128: it is not
    (the draft still runs CPU flex unfused: the compiled kernel fails to build on a dynamic-shape
    recompile, see `unfused_flex_forward`)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q_len, kv_len = 37, 293
    generator = torch.Generator().manual_seed(q_len)
    query = torch.randn(2, 4, q_len, 8, generator=generator)
    key, value = (torch.randn(2, 2, kv_len, 8, generator=generator) for _ in range(2))
    offset = kv_len - q_len

    def causal(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device="cpu")
    dense = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + offset
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=dense, enable_gqa=True)
    compiled = torch.compile(flex_attention)(query, key, value, block_mask=block_mask, enable_gqa=True)
    with warnings.catch_warnings():  # "called without torch.compile": the unfused reference, on purpose
        warnings.simplefilter("ignore")
        eager = flex_attention(query, key, value, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(compiled, expected, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(eager, expected, rtol=0, atol=TOLERANCE)


def test_flex_takes_bool_masks_as_block_masks_and_refuses_additive_ones():
    """transformers' flex path adds a tensor mask in a score_mod indexed `mask[b][0][q][kv]`, which
    torch 2.13's compiled CPU kernel reads out of bounds (it crashes the process): the draft hands
    flex a BlockMask instead, and an additive float mask (whose values a BlockMask cannot carry) is
    refused in one line."""
    draft = tiny_draft(seed=4, is_causal=True).eval()
    inputs = draft_inputs(draft.config, batch=2, context=7)
    kv_len = inputs["position_ids"].shape[1]
    visible = torch.rand(2, 1, 4, kv_len, generator=torch.Generator().manual_seed(0)) > 0.3
    visible[..., -4:] |= torch.eye(4, dtype=torch.bool)  # every query sees itself
    with torch.no_grad():
        expected = draft(**inputs, attention_mask=visible)
        draft.config._attn_implementation = "flex_attention"
        assert (draft(**inputs, attention_mask=visible) - expected).abs().max() <= TOLERANCE
        additive = torch.zeros(visible.shape).masked_fill(~visible, -1e9)
        with pytest.raises(ValueError, match=r"takes a bool attention mask or a flex BlockMask, not a torch\.float32"):
            draft(**inputs, attention_mask=additive)


def test_flex_forward_with_gradients_on_cpu_is_refused_in_one_line():
    draft = tiny_draft(seed=5)
    draft.config._attn_implementation = "flex_attention"
    inputs = draft_inputs(draft.config)
    with pytest.raises(ValueError, match=r"runs on CPU without gradients only \(torch has no CPU backward"):
        draft(**inputs)
    with torch.no_grad():  # the same call without gradients runs
        assert torch.isfinite(draft(**inputs)).all()
    draft.requires_grad_(False)  # frozen weights and inputs: nothing needs a backward either
    assert torch.isfinite(draft(**inputs)).all()


# -- decoding: a draft loaded with AutoModel(attn_implementation="flex_attention") ---------------------


@pytest.fixture(scope="module")
def decoding(tmp_path_factory) -> tuple[Any, DFlash2DraftModel, Any]:
    """(target, sdpa draft, the same draft saved and loaded by AutoModel with flex_attention); the
    draft has a full and a causal sliding-window layer, so serve-time masks are not all-visible."""
    target = tiny_target("qwen3", seed=1)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(20)  # peaked: drafts are often accepted
    config = tiny_draft_config_for(target, num_hidden_layers=2, **LAYERS["causal"])
    draft = randomize(DFlash2DraftModel(config), seed=2, scale=0.2).eval()
    directory = tmp_path_factory.mktemp("flex_draft")
    draft.save_pretrained(directory)
    flex = AutoModel.from_pretrained(directory, trust_remote_code=True, attn_implementation="flex_attention").eval()
    return target.model, draft, flex


def test_automodel_loads_a_flex_draft_that_runs_without_gradients_on_cpu(decoding):
    _, draft, flex = decoding
    assert type(flex).__name__ == "DFlash2DraftModel" and type(flex) is not DFlash2DraftModel  # remote code
    assert flex.config._attn_implementation == "flex_attention"
    assert flex.dflash.layer_sliding_window(1) == 3 and flex.dflash.layer_is_causal(1)
    inputs = draft_inputs(draft.config, batch=2, context=9, blocks=1)
    with torch.no_grad():
        gap = (flex(**inputs) - draft(**inputs)).abs().max()
    assert gap <= TOLERANCE


def recorded_decode(target, draft, prompt: list[int]) -> tuple[list[int], list[int], list[torch.Tensor]]:
    """(tokens, acceptance lengths, the draft's block outputs at each step) of greedy decoding."""
    seen: list[torch.Tensor] = []
    propose = draft.block_proposals

    def recording(hidden, *args, **kwargs):
        seen.append(hidden.clone())
        return propose(hidden, *args, **kwargs)

    draft.block_proposals = recording
    try:
        result = spec_generate(target, draft, torch.tensor([prompt]), max_new_tokens=24)
    finally:
        del draft.block_proposals
    return result.tokens, result.acceptance_lengths, seen


@pytest.mark.parametrize("prompt", [[1, 9, 14, 22, 7], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
def test_spec_generate_with_flex_equals_sdpa_token_for_token(decoding, prompt):
    target, draft, flex = decoding
    tokens, accepted, outputs = recorded_decode(target, draft, prompt)
    flex_tokens, flex_accepted, flex_outputs = recorded_decode(target, flex, prompt)
    assert flex_tokens == tokens and flex_accepted == accepted
    assert len(flex_outputs) == len(outputs) > 1  # several steps: later ones attend to the cache
    for step, (got, expected) in enumerate(zip(flex_outputs, outputs, strict=True)):
        assert (got - expected).abs().max() <= TOLERANCE, step


# -- training: refused before anything loads ------------------------------------------------------


def test_check_attention_for_training_refuses_flex_on_cpu_only():
    with pytest.raises(ValueError, match=r"^attn_implementation: flex_attention cannot train on CPU"):
        check_attention_for_training("flex_attention", torch.device("cpu"))
    check_attention_for_training("flex_attention", torch.device("cuda", 0))  # the GPU recipes keep flex
    check_attention_for_training("sdpa", torch.device("cpu"))


@pytest.fixture(scope="module")
def flex_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("flex_run")
    write_tiny_run(root, attn_implementation="flex_attention")
    return root


@pytest.mark.parametrize(
    "use_cpu",
    [
        True,
        pytest.param(False, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="trains on the GPU")),
    ],
)
def test_train_with_flex_on_cpu_stops_in_one_line_before_the_target_loads(
    flex_run, tmp_path, use_cpu, monkeypatch, capsys
):
    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(FrozenTarget, "load", no_target)
    output = tmp_path / "output"
    recipe = yaml.safe_load((flex_run / "recipe.yaml").read_text())
    recipe.update(output_dir=str(output), use_cpu=use_cpu)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit) as exit_info:
        run(train.main, [str(tmp_path / "recipe.yaml")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [f"error: {FLEX_ON_CPU}"], err
    assert "Traceback" not in err
    assert not output.exists()  # stopped before the run took its folder

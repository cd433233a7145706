"""A DFlash2 draft trained and exported by dflash2-hub, served by a real vLLM as its speculator.

The module trains a draft briefly on the demo recipe (a few dozen steps: enough for a mean
acceptance length clearly above 1), exports it with `dflash2 export`, and starts one vLLM
server with the target and that export (`--speculative-config` method "dflash", with
`num_speculative_tokens` = block_size - 1: vLLM sizes the DFlash2 convolutions' block from
`1 + num_speculative_tokens`). Then:

1. vLLM's own loader consumed every tensor of the export, and each vLLM parameter equals the
   exported tensor(s) it came from (the plugin's audit hook, DFLASH2_VLLM_AUDIT_DIR);
2. greedy speculative decoding gives exactly the target's own greedy tokens (HF `generate`);
3. per prompt, vLLM accepts exactly the draft tokens that the project's
   `spec_generate(use_selector=False)` accepts, step by step, up to a step decided by a near-tie
   of the draft's logits (then only the steps before it; most prompts have none).

On a CPU, vLLM has only its V1 model runner, which refuses DFlash2 ("candidate-head") drafts
because it drafts them through DFlashProposer without the candidate selector. This module lifts
that refusal (DFLASH2_VLLM_LIFT_CANDIDATE_REFUSAL=1, the plugin in
benchmarks/engines/vllm_cpu_plugin/), so the draft decodes unary here and is compared with
`use_selector=False`. The selector path is exercised only by vLLM's V2 (GPU) model runner.

DFLASH2_VLLM_DRAFT_EXPORT=<dir> reuses an existing export instead of training one (for iterating
on this file; CI trains its own).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.engines.vllm_server import VllmServer
from modeling_dflash2 import DFlash2DraftModel
from tests.e2e.engines.conftest import MAX_TOKENS, NUM_PROMPTS
from trainer.models.target import FrozenTarget

# A draft proposal whose top-2 logits are closer than this may flip between vLLM's float32 CPU
# kernels and transformers' (one at 8.3e-4 did); the draft's logits are of order 10.
NEAR_TIE = 5e-3
# vLLM -> checkpoint: the fused projections and the order of their parts (vLLM's
# DFlashQwen3Model.hf_to_vllm_mapper, orig_to_new_stacked; q, k, v and gate, up along dim 0).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Parameters of vLLM's draft that no export tensor feeds: embed_tokens and lm_head are replaced by
# the target's after loading (the proposer's _maybe_share_embeddings / _maybe_share_lm_head, as the
# project's draft uses the target's), and mask_embedding is used only with a mask_embedding.pt.
NOT_FROM_EXPORT = {"model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding"}


def test_vllm_loads_every_exported_tensor_unchanged(draft_server: VllmServer, draft_export: Path, engine_root: Path):
    # vLLM itself never reports a missing draft tensor: DFlash's load_weights returns nothing, so the
    # default loader's missing-weights check is skipped and an absent tensor stays uninitialised
    # memory. The export's own refusal of incomplete drafts is the only guard; this audit checks
    # that what vLLM holds is exactly what was exported.
    audit = engine_root / "draft-audit"
    record = json.loads((audit / "consumed.json").read_text())
    held = load_file(audit / "draft_params.safetensors")
    exported = load_file(draft_export / "model.safetensors")

    assert sorted(record["given"]) == sorted(exported), "vLLM's loader was not handed exactly the export's tensors"
    assert not record["has_own_embed_tokens"] and not record["has_own_lm_head"]

    expected: dict[str, torch.Tensor] = {}
    sources: dict[str, list[str]] = {}
    for fused, parts in FUSED.items():
        for name in exported:
            if name.endswith(f".{parts[0]}.weight"):
                names = [name.replace(f".{parts[0]}.", f".{part}.") for part in parts]
                vllm_name = "model." + name.replace(f".{parts[0]}.", f".{fused}.")
                expected[vllm_name] = torch.cat([exported[part] for part in names])
                sources[vllm_name] = names
    fused_parts = {name for names in sources.values() for name in names}
    for name, tensor in exported.items():
        if name not in fused_parts:
            vllm_name = name if name.startswith("lm_head") else "model." + name
            expected[vllm_name], sources[vllm_name] = tensor, [name]

    ignored = [names for vllm_name, names in sources.items() if vllm_name not in held]
    assert not ignored, f"export tensors with no vLLM parameter to load into: {ignored}"
    assert sorted(set(held) - set(expected)) == sorted(NOT_FROM_EXPORT)
    assert sorted(fused_parts) == sorted(n for n in exported if re.search(r"\.(q|k|v|gate|up)_proj\.", n))
    for vllm_name, tensor in expected.items():
        assert held[vllm_name].dtype == torch.float32, vllm_name
        # bf16 -> fp32 is exact: vLLM's copy must be bit for bit the exported values
        assert torch.equal(held[vllm_name], tensor.float()), f"{vllm_name} != {' + '.join(sources[vllm_name])}"
    print(f"\naudit: {len(exported)} exported tensors -> {len(expected)} vLLM parameters, all equal")


def test_greedy_speculative_tokens_equal_the_target_alone(
    vllm_runs: list[dict], prompts: list[list[int]], smollm2: FrozenTarget
):
    for ids, run in zip(prompts, vllm_runs, strict=True):
        with torch.no_grad():
            alone = smollm2.model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, attention_mask=torch.ones(1, len(ids))
            )
        assert run["tokens"] == alone[0, len(ids) :].tolist()
    assert sum(len(run["tokens"]) for run in vllm_runs) > NUM_PROMPTS * MAX_TOKENS // 2


def vllm_like_steps(acceptance_lengths: list[int], num_tokens: int) -> list[int]:
    """Accepted draft tokens per verification step, counted as vLLM counts them, of a decode that
    ends after `num_tokens` tokens.

    vLLM drafts a full block at every step and counts every accepted draft token, also those past
    max_tokens or a stop token in the final step (the scheduler counts the sampled tokens before it
    truncates them). `acceptance_lengths` must come from a spec_generate that neither stops nor
    reaches its max_new_tokens during these steps (so none is cut or drafted short): each is then
    accepted + 1. The steps are those vLLM runs: after the prefill's token, until num_tokens.
    """
    steps, produced = [], 1
    for length in acceptance_lengths:
        if produced >= num_tokens:
            break
        steps.append(length - 1)
        produced += length
    assert produced >= num_tokens, "spec_generate ended before vLLM's decode"
    return steps


def proposal_margins(draft: DFlash2DraftModel) -> list[torch.Tensor]:
    """Record, for each step of the draft's next decode, the top-1 minus top-2 logit of each
    proposal slot [B-1] (the draft computes its logits once per step)."""
    margins: list[torch.Tensor] = []
    compute_logits = draft.compute_logits

    def recording(hidden: torch.Tensor, output_head) -> torch.Tensor:
        logits = compute_logits(hidden, output_head)
        top = logits.float().topk(2, dim=-1).values
        margins.append((top[..., 0] - top[..., 1]).reshape(-1))
        return logits

    draft.compute_logits = recording
    return margins


def first_near_tie(margins: list[torch.Tensor], steps: list[int]) -> int | None:
    """The first step whose outcome hangs on a near-tie: one of the proposals that decided it (the
    accepted ones and the first rejected one) has a top-2 margin below NEAR_TIE. vLLM's float32 CPU
    kernels (fused projections, its own attention) round differently from transformers', so there a
    proposal may flip; every step before it must agree exactly."""
    for step, accepted in enumerate(steps):
        if float(margins[step][: accepted + 1].min()) < NEAR_TIE:
            return step
    return None


def test_acceptance_per_prompt_equals_spec_generate_without_selector(
    vllm_runs: list[dict], prompts: list[list[int]], smollm2: FrozenTarget, draft_export: Path, block_size: int
):
    draft = DFlash2DraftModel.from_pretrained(draft_export, dtype=torch.float32).eval()
    margins = proposal_margins(draft)
    totals = {"vllm_steps": 0, "vllm_accepted": 0, "project_steps": 0, "project_tokens": 0}
    decided = 0
    for ids, run in zip(prompts, vllm_runs, strict=True):
        # No stop tokens and room for a block past max_tokens: every step vLLM runs is a full,
        # uncut block here too (see vllm_like_steps).
        margins.clear()
        with torch.no_grad():
            output = draft.spec_generate(
                smollm2.model,
                torch.tensor([ids]),
                MAX_TOKENS + block_size,
                None,
                temperature=0.0,
                return_stats=True,
                use_selector=False,
            )
        assert len(margins) == len(output.acceptance_lengths)
        tokens = run["tokens"]
        assert output.new_tokens[: len(tokens)] == tokens
        steps = vllm_like_steps(output.acceptance_lengths, len(tokens))
        metrics, counters = run["metrics"], run["counters"]
        vllm_steps = metrics["per_step_accepted"]
        assert metrics["per_step_drafted"] == [block_size - 1] * len(vllm_steps)
        assert counters["drafts"] == len(vllm_steps)
        assert counters["draft_tokens"] == (block_size - 1) * len(vllm_steps)
        assert counters["accepted_tokens"] == sum(vllm_steps)
        per_position = [counters.get(f"accepted_tokens_per_pos/{i}", 0.0) for i in range(block_size - 1)]
        assert per_position == [sum(accepted > i for accepted in vllm_steps) for i in range(block_size - 1)]

        tie = first_near_tie(margins, steps)
        if tie is None:
            assert vllm_steps == steps
            decided += 1
        else:  # equal up to the step a near-tie decides
            assert vllm_steps[:tie] == steps[:tie], (tie, vllm_steps, steps)

        # vLLM's tau counts the final step whole; the project's own statistics cut that step at
        # max_new_tokens or the stop token (SpeculativeOutput.acceptance_lengths), as below.
        lengths = [accepted + 1 for accepted in steps]
        lengths[-1] -= sum(lengths) - (len(tokens) - 1)
        print(f"\nprompt of {len(ids)} tokens: {len(tokens)} tokens, accepted per step {steps}, near-tie at {tie}")
        totals["vllm_steps"] += len(vllm_steps)
        totals["vllm_accepted"] += sum(vllm_steps)
        totals["project_steps"] += len(lengths)
        totals["project_tokens"] += sum(lengths)

    # most prompts are decided with no near-tie at all, so the comparison keeps its teeth
    assert decided >= NUM_PROMPTS // 2, f"only {decided} of {NUM_PROMPTS} prompts free of near-ties"
    tau_vllm = 1 + totals["vllm_accepted"] / totals["vllm_steps"]
    tau_project = totals["project_tokens"] / totals["project_steps"]
    print(
        f"tau over {NUM_PROMPTS} prompts: vLLM {tau_vllm:.3f} ({totals['vllm_steps']} steps), "
        f"project (final step cut) {tau_project:.3f}"
    )
    assert tau_vllm > 1.25, "the briefly trained draft should accept clearly more than nothing"

"""The shipped `spec_generate`: z-lab's call, lossless greedy at any length, short final blocks,
top-k/top-p sampling that follows the target's filtered distribution, KV caches, stats, and the
README snippet in a process that cannot import this repository."""

from __future__ import annotations

import inspect
import math
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

from modeling_dflash2 import DFlash2DraftModel, DFlashDraftModel, SamplingSettings, SpeculativeOutput
from modeling_dflash2.configuration_dflash2 import DFlash2Config
from modeling_dflash2.generation_dflash2 import BlockProposals, rejection_sample
from tests.support.drafts import randomize
from tests.support.isolation import WITHOUT_THIS_REPO
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from tests.unit.evaluation.test_speculative import PROMPTS, build_small_vocab_pair, chi_square_p_value

README = Path(__file__).resolve().parents[3] / "README.md"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request):
    target = tiny_target(request.param, seed=1)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(20)  # peaked: long agreeing runs, no near-ties
    draft = randomize(DFlash2DraftModel(tiny_draft_config_for(target)), seed=2, scale=0.2)
    return target.model, draft


def v1_draft_for(draft: DFlash2DraftModel) -> DFlashDraftModel:
    """The same backbone as a DFlash v1 draft (no conv, no selector fields in the config)."""
    values = draft.config.to_dict()
    dflash = {
        key: value for key, value in values["dflash_config"].items() if not key.startswith(("conv_", "selector_"))
    }
    values.update(dflash_config=dflash, architectures=["DFlashDraftModel"])
    v1 = DFlashDraftModel(DFlash2Config(**values))
    v1.load_state_dict(draft.state_dict(), strict=False)
    return v1.eval()


def generate_greedy(target, prompt: list[int], new_tokens: int, eos: int | None = None) -> torch.Tensor:
    return target.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )


# ---------------------------------------------------------------------------------------------
# z-lab's call and result
# ---------------------------------------------------------------------------------------------


def test_signature_is_z_labs_with_keyword_only_extras():
    for cls in (DFlashDraftModel, DFlash2DraftModel):
        parameters = list(inspect.signature(cls.spec_generate).parameters.values())[1:]
        positional = [(p.name, p.default) for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
        empty = inspect.Parameter.empty
        assert positional == [
            ("target", empty),
            ("input_ids", empty),
            ("max_new_tokens", empty),
            ("stop_token_ids", empty),
            ("temperature", 0.0),
            ("top_p", 1.0),
            ("top_k", 0),
        ]
        extras = {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY}
        assert extras == {"return_stats": False, "use_selector": True, "generator": None}


@pytest.mark.parametrize(
    "new_tokens",
    [
        1,
        2,
        pytest.param(5, marks=pytest.mark.slow),
        pytest.param(7, marks=pytest.mark.slow),
        pytest.param(13, marks=pytest.mark.slow),
    ],
)
def test_greedy_returns_the_targets_generate_ids_at_any_length(pair, new_tokens):
    """[1, P + n], equal to `generate` token for token, n not tied to the block size (B = 4)."""
    target, draft = pair
    for prompt in PROMPTS:
        out = draft.spec_generate(target, torch.tensor([prompt]), new_tokens, None)
        assert out.shape == (1, len(prompt) + new_tokens)
        assert torch.equal(out, generate_greedy(target, prompt, new_tokens))


def test_greedy_is_lossless_on_a_sliding_window_target():
    """The target's cache has sliding-window layers (window 5, shorter than the prompts): cutting
    it back after a rejected tail must still leave exactly the verified prefix."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.support.tiny_target import tiny_tokenizer
    from trainer.models.target import FrozenTarget

    tokenizer = tiny_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
        use_sliding_window=True,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    torch.manual_seed(1)
    target = Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(20)
    draft = randomize(DFlash2DraftModel(tiny_draft_config_for(FrozenTarget(target, tokenizer))), seed=2, scale=0.2)
    for prompt in ([1, 9, 14, 22, 7, 5, 6, 8, 9, 10], [1, 30, 31]):
        for new_tokens in (7, 25):
            out = draft.spec_generate(target, torch.tensor([prompt]), new_tokens, None)
            assert torch.equal(out, generate_greedy(target, prompt, new_tokens))


@pytest.mark.slow
def test_dflash_v1_draft_has_the_same_method(pair):
    target, draft = pair
    v1 = v1_draft_for(draft)
    assert not hasattr(v1, "candidate_selector")
    for prompt in PROMPTS[:2]:
        out = v1.spec_generate(target=target, input_ids=torch.tensor([prompt]), max_new_tokens=11, stop_token_ids=None)
        assert torch.equal(out, generate_greedy(target, prompt, 11))


def test_stop_token_is_kept_and_ends_generation(pair):
    target, draft = pair
    prompt = PROMPTS[1]
    free = generate_greedy(target, prompt, 30)[0, len(prompt) :].tolist()
    stop = free[6]
    out = draft.spec_generate(target, torch.tensor([prompt]), 30, [stop])
    assert torch.equal(out, generate_greedy(target, prompt, 30, eos=stop))
    new = out[0, len(prompt) :].tolist()
    assert new[-1] == stop and stop not in new[:-1]
    # a stop token as the very first new token: one token, no step
    stats = draft.spec_generate(target, torch.tensor([prompt]), 30, [free[0]], return_stats=True)
    assert stats.new_tokens == [free[0]] and stats.acceptance_lengths == []


@pytest.mark.slow
def test_return_stats_fields(pair):
    target, draft = pair
    prompt = PROMPTS[2]
    plain = draft.spec_generate(target, torch.tensor([prompt]), 13, None)
    stats = draft.spec_generate(target, torch.tensor([prompt]), 13, None, return_stats=True)
    assert isinstance(stats, SpeculativeOutput)
    assert torch.equal(stats.output_ids, plain)
    assert (stats.num_input_tokens, stats.num_output_tokens) == (len(prompt), 13)
    assert sum(stats.acceptance_lengths) == 12  # every token after the prefill's came from a step
    assert all(1 <= n <= draft.block_size for n in stats.acceptance_lengths)
    assert stats.time_to_first_token > 0 and stats.decode_seconds > 0
    assert stats.time_per_output_token == pytest.approx(stats.decode_seconds / 13)


def test_bad_arguments_are_named(pair):
    target, draft = pair
    prompt = torch.tensor([PROMPTS[0]])
    with pytest.raises(ValueError, match="batch size 1"):
        draft.spec_generate(target, torch.tensor([[1, 2], [3, 4]]), 4, None)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        draft.spec_generate(target, prompt, 0, None)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        draft.spec_generate(target, prompt, 4, None, 0.7, top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be a non-negative integer"):
        draft.spec_generate(target, prompt, 4, None, 0.7, top_k=-1)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        draft.spec_generate(target, prompt, 4, None, float("nan"))


# ---------------------------------------------------------------------------------------------
# Short final blocks and KV caches
# ---------------------------------------------------------------------------------------------


class Recorder:
    """Records the query lengths the target and the draft see, and the draft's context lengths."""

    def __init__(self, target, draft):
        self.target_lengths, self.draft_blocks, self.draft_contexts = [], [], []
        self.handles = [
            target.register_forward_pre_hook(self._target, with_kwargs=True),
            draft.register_forward_pre_hook(self._draft, with_kwargs=True),
        ]

    def _target(self, module, args, kwargs):
        self.target_lengths.append(kwargs["input_ids"].shape[1])

    def _draft(self, module, args, kwargs):
        self.draft_blocks.append(kwargs["noise_embedding"].shape[1])
        self.draft_contexts.append(kwargs["target_hidden"].shape[1])

    def remove(self):
        for handle in self.handles:
            handle.remove()


@pytest.mark.slow
def test_each_token_is_encoded_once_and_the_last_block_is_short(pair):
    """KV caches: the target sees the prompt once, then only blocks; the draft gets each verified
    token's features once. With 13 new tokens and B = 4 the final block has what is left + 1."""
    target, draft = pair
    prompt = PROMPTS[0]
    recorder = Recorder(target, draft)
    try:
        stats = draft.spec_generate(target, torch.tensor([prompt]), 13, None, return_stats=True)
    finally:
        recorder.remove()
    steps = stats.acceptance_lengths
    assert recorder.target_lengths[0] == len(prompt)
    assert len(recorder.target_lengths) == len(steps) + 1
    # the block of step i: min(B, tokens left + 1); tokens left = 13 - 1 - tokens produced before it
    produced_before = [sum(steps[:i]) for i in range(len(steps))]
    expected_blocks = [min(draft.block_size, 13 - 1 - done + 1) for done in produced_before]
    assert recorder.target_lengths[1:] == expected_blocks == recorder.draft_blocks
    assert expected_blocks[-1] < draft.block_size or 12 % draft.block_size == 0  # the tail block was short
    # context: the prompt first, then exactly the tokens the previous step produced
    assert recorder.draft_contexts == [len(prompt), *steps[:-1]]


def test_short_block_forward_matches_the_naive_reference():
    from tests.support import naive_dflash
    from tests.support.drafts import draft_inputs, tiny_draft

    model = tiny_draft(seed=3).eval()
    full = draft_inputs(model.config, batch=2, context=5)
    for slots in (1, 2, 3):
        inputs = dict(
            full,
            noise_embedding=full["noise_embedding"][:, :slots],
            position_ids=full["position_ids"][:, : 5 + slots],
        )
        with torch.no_grad():
            out = model(**inputs)
        for row in range(2):
            expected = naive_dflash.forward(
                model,
                inputs["position_ids"][row],
                inputs["noise_embedding"][row],
                inputs["target_hidden"][row],
                naive_dflash.serving_visibility(model),
            )
            torch.testing.assert_close(out[row].double(), expected, atol=2e-5, rtol=1e-4)


def test_short_block_proposals_equal_a_slot_by_slot_selector_walk():
    """propose() on 1..B-1 slots against z-lab's walk: one slot at a time, each pick the next
    slot's predecessor, scores = unary + transition over the unary top-K."""
    from tests.support.drafts import tiny_draft

    model = tiny_draft(seed=4).eval()
    generator = torch.Generator().manual_seed(5)
    head = torch.randn(50, 32, generator=generator) * 3
    anchors = torch.tensor([7, 19])
    for slots in (1, 2, 3):
        hidden = torch.randn(2, slots, 32, generator=generator)
        with torch.no_grad():
            tokens, candidates, q = model.propose(hidden, anchors, head)
            logits = model.compute_logits(hidden, head)
            predecessor, expected = anchors, []
            for slot in range(slots):
                scores = model.candidate_selector.score(hidden[:, slot], logits[:, slot], predecessor)
                predecessor = scores.candidate_ids.gather(1, scores.scores.argmax(-1, keepdim=True))[:, 0]
                expected.append(predecessor)
        assert q is None and candidates.shape == (2, slots, model.dflash.selector_top_k)
        assert torch.equal(tokens, torch.stack(expected, dim=1))


def test_conv_on_one_short_block_by_hand():
    from modeling_dflash2 import grouped_dynamic_causal_conv

    # the hand example of test_modeling_dflash2_conv, three rows of one block of 4
    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    base = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    dynamic = torch.zeros(1, 3, 2, 2)
    dynamic[0, 1, 1, 0] = 0.5  # t = 1, tap 1, group 0
    out = grouped_dynamic_causal_conv(x, base, dynamic, block_size=4)
    # t=0: [1, 4]; t=1: [3, 8] + [(0.5 + 0.5) * 1, -1 * 2]; t=2: [5, 12] + [0.5 * 3, -1 * 4]
    assert out[0].tolist() == [[1.0, 4.0], [4.0, 6.0], [6.5, 8.0]]
    with pytest.raises(ValueError, match="only a single block may be shorter"):
        grouped_dynamic_causal_conv(torch.zeros(1, 6, 2), base, torch.zeros(1, 6, 2, 2), block_size=4)


# ---------------------------------------------------------------------------------------------
# Sampling: filtering, rejection, and the output distribution
# ---------------------------------------------------------------------------------------------


def test_filtering_by_hand():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    probs = lambda **kwargs: SamplingSettings(1.0, **kwargs).probabilities(logits).tolist()  # noqa: E731
    assert probs() == pytest.approx([0.4, 0.3, 0.2, 0.1])
    assert probs(top_k=3) == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0.0])
    # top-p keeps a token while the mass before it is < top_p: 0 and 0.4 < 0.6, 0.7 is not
    assert probs(top_p=0.6) == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0])
    assert probs(top_p=0.75) == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0.0])
    # top-k first, then top-p on the renormalised rest: mass before = 0, 4/9, 7/9
    assert probs(top_k=3, top_p=0.5) == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0])
    assert probs(top_k=4) == probs() and probs(top_k=9) == probs()  # k >= V: no filter
    # temperature 2 halves the logits: probabilities proportional to sqrt(p)
    roots = [math.sqrt(p) for p in (0.4, 0.3, 0.2, 0.1)]
    expected = [r / sum(roots) for r in roots]
    assert SamplingSettings(2.0).probabilities(logits).tolist() == pytest.approx(expected)


def test_residual_by_hand():
    target_probs = torch.tensor([0.1, 0.6, 0.3])
    # q over the selector's candidates [1, 2]: (p - q)+ = [0.1, 0.1, 0] -> [0.5, 0.5, 0]
    on_candidates = BlockProposals(torch.tensor([[2]]), torch.tensor([[[0.5, 0.5]]]), torch.tensor([[[1, 2]]]))
    assert on_candidates.residual(target_probs, 0).tolist() == pytest.approx([0.5, 0.5, 0.0])
    assert on_candidates.probability_of_tokens().tolist() == [0.5]
    # q over the vocabulary; p <= q everywhere -> nothing left: fall back to p
    on_vocab = BlockProposals(torch.tensor([[1]]), torch.tensor([[[0.1, 0.6, 0.3]]]))
    assert on_vocab.residual(target_probs, 0).tolist() == pytest.approx([0.1, 0.6, 0.3])


def test_rejection_sample_accepts_while_q_le_p_and_rejects_where_p_is_zero():
    generator = torch.Generator().manual_seed(0)
    one_hot = torch.eye(4)
    # proposals 1, 2 with q = p: always accepted (u * q < p); the last row is one-hot on 3
    target_probs = torch.stack([torch.tensor([0.0, 0.5, 0.0, 0.5]), torch.tensor([0.0, 0.0, 1.0, 0.0]), one_hot[3]])
    proposals = BlockProposals(torch.tensor([[1, 2]]), target_probs[None, :2].clone())
    for _ in range(20):
        assert rejection_sample(proposals, target_probs, generator) == (2, torch.tensor(3))
    # p(proposal 0) = 0: rejected at slot 0; residual (p - q)+ puts all mass on token 3
    proposals = BlockProposals(torch.tensor([[0, 2]]), torch.stack([one_hot[0], one_hot[2]])[None])
    target_probs = torch.stack([one_hot[3], one_hot[2], one_hot[1]])
    for _ in range(20):
        assert rejection_sample(proposals, target_probs, generator) == (0, torch.tensor(3))


def filtered(probs: list[float], top_k: int, top_p: float) -> list[float]:
    """A second, plain implementation of the filter, for the expected distribution."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if 0 < top_k < len(probs) else order
    mass = sum(probs[i] for i in kept)
    survivors, before = [], 0.0
    for i in kept:
        if before < top_p:
            survivors.append(i)
        before += probs[i] / mass
    total = sum(probs[i] for i in survivors)
    return [probs[i] / total if i in survivors else 0.0 for i in range(len(probs))]


@torch.no_grad()
def exact_filtered_joint(target, prompt, length, temperature, top_k, top_p):
    joint = {(): 1.0}
    for _ in range(length):
        extended = {}
        for prefix, mass in joint.items():
            logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            row = filtered(torch.softmax(logits / temperature, -1).tolist(), top_k, top_p)
            for token, p in enumerate(row):
                if p > 0:
                    extended[(*prefix, token)] = mass * p
        joint = extended
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("draft_kind", ["selector", "unary", "v1"])
def test_top_k_top_p_sampling_follows_the_targets_filtered_distribution(draft_kind):
    target, draft = build_small_vocab_pair()
    if draft_kind == "v1":
        draft = v1_draft_for(draft)
    prompt, length, temperature, top_k, top_p, samples = [0, 3, 1, 4], 3, 1.0, 4, 0.8, 1200
    expected = exact_filtered_joint(target, prompt, length, temperature, top_k, top_p)
    assert len(expected) < 6**length / 4  # the filter really removes outcomes
    generator = torch.Generator().manual_seed(21)
    counts, accepted = Counter(), 0
    for _ in range(samples):
        stats = draft.spec_generate(
            target,
            torch.tensor([prompt]),
            length,
            None,
            temperature,
            top_p,
            top_k,
            return_stats=True,
            use_selector=draft_kind == "selector",
            generator=generator,
        )
        counts[tuple(stats.new_tokens)] += 1
        accepted += sum(stats.acceptance_lengths) - len(stats.acceptance_lengths)
    assert accepted > 0.05 * samples  # proposals really are accepted (the test has teeth)
    assert set(counts) <= set(expected)  # nothing the filter removes is ever produced
    assert chi_square_p_value(counts, expected, samples) > 1e-3  # fixed seed; reject below p = 0.001


# ---------------------------------------------------------------------------------------------
# The README snippet, in a process that cannot import this repository
# ---------------------------------------------------------------------------------------------

AFTER_SNIPPET = textwrap.dedent(
    """
    import torch
    assert "transformers_modules" in type(draft).__module__, type(draft).__module__
    results = {"readme": out, "prompt": input_ids}
    results["greedy"] = draft.spec_generate(
        target=target, input_ids=input_ids, max_new_tokens=13, stop_token_ids=None, temperature=0.0
    )
    torch.manual_seed(0)
    results["sampled"] = draft.spec_generate(
        target=target, input_ids=input_ids, max_new_tokens=13, stop_token_ids=None,
        temperature=0.8, top_p=0.9, top_k=20,
    )
    torch.save(results, sys.argv[2])
    """
)


def readme_snippet() -> str:
    section = README.read_text().split("## Use a draft in plain transformers", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_snippet_runs_on_a_saved_draft_where_this_repo_cannot_be_imported(tmp_path):
    frozen = tiny_target("llama", seed=1)
    target, tokenizer = frozen.model, frozen.tokenizer
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(20)
    draft = randomize(DFlash2DraftModel(tiny_draft_config_for(frozen)), seed=2, scale=0.2)
    draft.save_pretrained(tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    snippet = readme_snippet()
    assert "draft.spec_generate(" in snippet and "trust_remote_code=True" in snippet
    snippet = re.sub(r'draft_path = ".*?"', f'draft_path = "{tmp_path / "draft"}"', snippet)
    snippet = re.sub(r'target_path = ".*?"', f'target_path = "{tmp_path / "target"}"', snippet)
    repo = str(Path(__file__).resolve().parents[3])
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH" and not key.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_THIS_REPO + snippet + AFTER_SNIPPET, repo, str(tmp_path / "out.pt")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(tmp_path / "out.pt", weights_only=True)
    prompt = remote["prompt"][0].tolist()
    eos = tokenizer.eos_token_id
    assert torch.equal(remote["readme"], generate_greedy(target, prompt, 90, eos=eos))
    assert torch.equal(remote["greedy"], generate_greedy(target, prompt, 13))  # 13: not a multiple of B
    sampled = remote["sampled"]
    assert sampled.shape == (1, len(prompt) + 13) and torch.equal(sampled[0, : len(prompt)], remote["prompt"][0])

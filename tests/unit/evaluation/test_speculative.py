"""Speculative decoding: greedy is lossless, sampling follows the target's distribution."""

from __future__ import annotations

import inspect
import math
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_dflash2 import DFlash2DraftModel
from modeling_dflash2.generation_dflash2 import BlockProposals
from tests.support.drafts import randomize, tiny_config, tiny_dflash_config
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.evaluation.speculative import spec_generate, target_generate

PROMPTS = [[1, 9, 14, 22, 7], [1, 30, 31], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 40]]


def greedy_reference(model, prompt, new_tokens, eos=None):
    output = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    return output[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request):
    target = tiny_target(request.param, seed=1)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(20)  # peaked, far-from-tied distributions
    draft = randomize(DFlash2DraftModel(tiny_draft_config_for(target)), seed=2, scale=0.2)
    return target.model, draft


@pytest.mark.slow
@pytest.mark.parametrize("use_selector", [True, False])
def test_greedy_speculative_output_equals_target_greedy_generate(pair, use_selector):
    target, draft = pair
    for prompt in PROMPTS:
        result = spec_generate(target, draft, torch.tensor([prompt]), max_new_tokens=20, use_selector=use_selector)
        assert result.tokens == greedy_reference(target, prompt, 20)
        assert sum(result.acceptance_lengths) == 19  # every token after the first came from a step
        assert all(1 <= n <= draft.block_size for n in result.acceptance_lengths)


class OracleProposals:
    """Proposes the target's true greedy continuation except at slot `wrong`, so every step must
    accept exactly `wrong` proposals and add the target's token. Installed as the draft's
    `block_proposals`, so the draft's forward and caches still run."""

    def __init__(self, greedy, wrong):
        self.greedy, self.wrong, self.anchor_index = greedy, wrong, 0

    def __call__(self, hidden, anchor, head, sampling, use_selector, generator):
        assert int(anchor) == self.greedy[self.anchor_index]
        slots = hidden.shape[1]
        upcoming = self.greedy[self.anchor_index + 1 : self.anchor_index + 1 + slots]
        tokens = torch.tensor(upcoming + [0] * (slots - len(upcoming)), device=hidden.device)
        if self.wrong < len(tokens):
            tokens[self.wrong] = (tokens[self.wrong] + 1) % head.weight.shape[0]
        self.anchor_index += self.wrong + 1
        return BlockProposals(tokens[None])


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [0, 1, 2, 3])
def test_partial_acceptance_keeps_caches_and_context_exact(pair, monkeypatch, wrong):
    target, draft = pair
    prompt = PROMPTS[0]
    greedy = greedy_reference(target, prompt, 40)
    monkeypatch.setattr(draft, "block_proposals", OracleProposals(greedy, wrong))
    result = spec_generate(target, draft, torch.tensor([prompt]), max_new_tokens=25)
    assert result.tokens == greedy[:25]
    per_step = wrong + 1  # accepted proposals + the target's token (all 3 accepted when wrong == 3)
    assert result.acceptance_lengths[:-1] == [per_step] * (len(result.acceptance_lengths) - 1)


def test_stop_tokens_end_generation_like_generate(pair):
    target, draft = pair
    prompt = PROMPTS[1]
    free = greedy_reference(target, prompt, 30)
    stop = free[6]
    result = spec_generate(target, draft, torch.tensor([prompt]), max_new_tokens=30, stop_token_ids=[stop])
    assert result.tokens == greedy_reference(target, prompt, 30, eos=stop)
    assert result.tokens[-1] == stop and stop not in result.tokens[:-1]


def test_batch_size_one_only(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="batch size 1"):
        spec_generate(target, draft, torch.tensor([[1, 2], [3, 4]]), max_new_tokens=4)


# ---------------------------------------------------------------------------------------------
# Sampling: the output distribution is the target's
# ---------------------------------------------------------------------------------------------

VOCAB = 6


@pytest.fixture(scope="module")
def small_vocab_pair():
    return build_small_vocab_pair()


def build_small_vocab_pair():
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(6)
    draft_config = tiny_config(
        num_hidden_layers=1,
        layer_types=["full_attention"],
        vocab_size=VOCAB,
        num_target_layers=3,
        dflash_config=tiny_dflash_config(mask_token_id=5, target_layer_ids=[0, 2], selector_rank=4, selector_top_k=3),
    )
    draft = randomize(DFlash2DraftModel(draft_config), seed=4, scale=0.5)
    return target, draft


@torch.no_grad()
def exact_joint(target, prompt, length, temperature):
    """P(next `length` tokens) under plain sampling, by enumerating every prefix."""
    probabilities = {(): 1.0}
    for _ in range(length):
        extended = {}
        for prefix, mass in probabilities.items():
            logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            for token, p in enumerate(torch.softmax(logits / temperature, -1).tolist()):
                extended[(*prefix, token)] = mass * p
        probabilities = extended
    return probabilities


def chi_square_p_value(counts: Counter, expected: dict, samples: int) -> float:
    """Pearson chi-square against `expected` probabilities, cells under 5 expected pooled."""
    statistic, pooled_observed, pooled_expected, cells = 0.0, 0, 0.0, 0
    for outcome, probability in expected.items():
        if probability * samples < 5:
            pooled_observed += counts.get(outcome, 0)
            pooled_expected += probability * samples
            continue
        statistic += (counts.get(outcome, 0) - probability * samples) ** 2 / (probability * samples)
        cells += 1
    if pooled_expected > 0:
        statistic += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        cells += 1
    freedom = cells - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2.0), torch.tensor(statistic / 2.0)))


@pytest.mark.slow
@pytest.mark.parametrize(("use_selector", "samples"), [(True, 1500), (False, 1000)])
def test_sampled_speculative_output_follows_the_target_distribution(small_vocab_pair, use_selector, samples):
    target, draft = small_vocab_pair
    prompt, length, temperature = [0, 3, 1, 4], 3, 1.0
    expected = exact_joint(target, prompt, length, temperature)
    generator = torch.Generator().manual_seed(11)
    counts = Counter()
    accepted = 0
    for _ in range(samples):
        result = spec_generate(
            target,
            draft,
            torch.tensor([prompt]),
            max_new_tokens=length,
            temperature=temperature,
            use_selector=use_selector,
            generator=generator,
        )
        counts[tuple(result.tokens)] += 1
        accepted += sum(result.acceptance_lengths) - len(result.acceptance_lengths)
    assert accepted > 0.05 * samples  # proposals really are accepted sometimes (the test has teeth)
    # fixed seed; tolerance: reject only below p = 0.001
    assert chi_square_p_value(counts, expected, samples) > 1e-3
    total_variation = 0.5 * sum(abs(counts.get(o, 0) / samples - p) for o, p in expected.items())
    assert total_variation < 0.2  # loose sanity bound; the chi-square above is the test


@pytest.mark.slow
def test_the_chi_square_check_catches_a_wrong_distribution(small_vocab_pair):
    """Control: sampling at another temperature must fail the same check."""
    target, _ = small_vocab_pair
    prompt, samples = [0, 3, 1, 4], 1500
    expected = exact_joint(target, prompt, 3, 1.0)
    generator = torch.Generator().manual_seed(12)
    counts = Counter(
        tuple(
            target_generate(
                target, torch.tensor([prompt]), max_new_tokens=3, temperature=1.6, generator=generator
            ).tokens
        )
        for _ in range(samples)
    )
    assert chi_square_p_value(counts, expected, samples) < 1e-3


def test_target_generate_greedy_matches_generate(pair):
    target, _ = pair
    assert target_generate(target, torch.tensor([PROMPTS[2]]), max_new_tokens=15).tokens == greedy_reference(
        target, PROMPTS[2], 15
    )
    assert not math.isnan(target_generate(target, torch.tensor([PROMPTS[2]]), max_new_tokens=3).mean_acceptance)


def test_wrappers_refuse_positional_decoding_settings(pair):
    """The shipped `draft.spec_generate` orders (max_new_tokens, stop_token_ids, temperature), the wrapper
    (max_new_tokens, temperature, stop_token_ids): positional settings would be swapped silently, so none are
    taken."""
    target, draft = pair
    prompt = torch.tensor([PROMPTS[0]])
    with pytest.raises(TypeError):
        spec_generate(target, draft, prompt, 4)
    with pytest.raises(TypeError):
        spec_generate(target, draft, prompt, 4, 0.7)
    with pytest.raises(TypeError):
        target_generate(target, prompt, 4)
    with pytest.raises(TypeError):
        target_generate(target, prompt, 4, 0.7)
    for wrapper in (spec_generate, target_generate):
        after_ids = list(inspect.signature(wrapper).parameters.values())[3 if wrapper is spec_generate else 2 :]
        assert all(parameter.kind is inspect.Parameter.KEYWORD_ONLY for parameter in after_ids), wrapper.__name__
    assert len(spec_generate(target, draft, prompt, max_new_tokens=4, temperature=0.0).tokens) == 4

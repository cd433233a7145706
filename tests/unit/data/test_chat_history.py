"""Issue 34: a template that rewrites history as Qwen3's does (tests/fixtures/qwen3_like_chat_template.jinja),
thinking on, off and mixed, and tool calls: every assistant turn is supervised against the prompt the engine
renders for it, token by token; such conversations are never refused, train, and regenerate with their thinking."""

from __future__ import annotations

import json

import datasets
import pytest

from tests.support.qwen3_like import qwen3_like_tokenizer
from trainer.data.chat import tokenize_chat, tokenize_chat_samples
from trainer.data.dataset import check_chat_columns, conversation_problem, tokenize_conversations
from trainer.data.regeneration import conversation_thinking

THREE_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "<think>\nr2\n</think>\n\na2"},  # inline reasoning, as generate writes it
    {"role": "user", "content": "q3"},
    {"role": "assistant", "content": "a3", "reasoning_content": "r3"},
]
WEATHER = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "call it",
        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "Sunny.", "reasoning_content": "done"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return qwen3_like_tokenizer()


def expected(tokenizer, *segments: tuple[str, int]) -> dict[str, list[int]]:
    """The sample of text segments, each supervised (1) or not (0): one token per character or tag."""
    ids, mask = [], []
    for text, supervised in segments:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        ids += tokens
        mask += [supervised] * len(tokens)
    return {"input_ids": ids, "loss_mask": mask}


def shown(tokenizer, sample) -> list[tuple[str, int]]:
    """A sample as runs of (text, mask), for a readable failure."""
    runs: list[tuple[list[int], int]] = []
    for token, mask in zip(sample["input_ids"], sample["loss_mask"], strict=True):
        if runs and runs[-1][1] == mask:
            runs[-1][0].append(token)
        else:
            runs.append(([token], mask))
    return [(tokenizer.decode(ids), mask) for ids, mask in runs]


SYSTEM = "<|im_start|>system\nBe brief.<|im_end|>\n"


def turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def test_three_thinking_turns_are_three_samples_each_as_the_engine_sees_it(tokenizer):
    """Thinking on: the engine answers turn 2 from a prompt where turn 1's reasoning is gone, so each
    turn is its own sample, its reasoning and answer through <|im_end|> supervised, nothing else."""
    samples = tokenize_chat_samples(tokenizer, THREE_TURNS)
    history = SYSTEM + turn("user", "q1")
    wanted = [
        expected(tokenizer, (history + "<|im_start|>assistant\n", 0), ("<think>\nr1\n</think>\n\na1<|im_end|>", 1)),
        expected(
            tokenizer,
            (history + turn("assistant", "a1") + turn("user", "q2") + "<|im_start|>assistant\n", 0),
            ("<think>\nr2\n</think>\n\na2<|im_end|>", 1),
        ),
        expected(
            tokenizer,
            (
                history
                + turn("assistant", "a1")
                + turn("user", "q2")
                + turn("assistant", "a2")
                + turn("user", "q3")
                + "<|im_start|>assistant\n",
                0,
            ),
            ("<think>\nr3\n</think>\n\na3<|im_end|>", 1),
            ("\n", 0),
        ),
    ]
    assert [shown(tokenizer, s) for s in samples] == [shown(tokenizer, w) for w in wanted]
    assert samples == wanted
    # each supervised span follows exactly the prompt the engine renders for its turn
    for sample, end in zip(samples, (2, 4, 6), strict=True):
        prompt = tokenizer.apply_chat_template(THREE_TURNS[:end], add_generation_prompt=True, return_dict=True)
        start = sample["loss_mask"].index(1)
        assert sample["input_ids"][:start] == list(prompt["input_ids"])
    # the tokens are what they say: one per character, the tags one each
    think = tokenizer.convert_tokens_to_ids("<think>")
    assert samples[0]["input_ids"][samples[0]["loss_mask"].index(1)] == think
    assert sum(samples[0]["loss_mask"]) == 1 + 1 + 2 + 1 + 1 + 2 + 2 + 1  # <think> \n r1 \n </think> \n\n a1 <|im_end|>
    # the single-sample helper says why it cannot return one
    with pytest.raises(ValueError, match=r"is 3 samples.*tokenize_chat_samples"):
        tokenize_chat(tokenizer, THREE_TURNS)


def test_thinking_off_supervises_the_empty_think_block_the_prompt_ends_with(tokenizer):
    """Thinking off: the prompt ends with an empty think block and the engine answers without
    reasoning; the data's reasoning is dropped, and earlier turns appear without the empty block."""
    samples = tokenize_chat_samples(tokenizer, THREE_TURNS, enable_thinking=False)
    off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    history = SYSTEM + turn("user", "q1")
    assert samples[0] == expected(tokenizer, (history + off, 0), ("a1<|im_end|>", 1))
    assert samples[1] == expected(
        tokenizer, (history + turn("assistant", "a1") + turn("user", "q2") + off, 0), ("a2<|im_end|>", 1)
    )
    last = history + turn("assistant", "a1") + turn("user", "q2") + turn("assistant", "a2") + turn("user", "q3")
    assert samples[2] == expected(tokenizer, (last + off, 0), ("a3<|im_end|>", 1), ("\n", 0))
    assert len(samples) == 3


def test_tool_calls_are_supervised_and_tool_results_are_not(tokenizer):
    """After the last user query the template keeps every turn's reasoning, so the tool call and the
    final answer share one sample; the tools list and the tool result are prompt."""
    samples = tokenize_chat_samples(tokenizer, TOOL_CONVERSATION, tools=[WEATHER])
    system = (
        "<|im_start|>system\n# Tools\n\nYou may call functions. Signatures:\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False)
        + '\n</tools>\n\nCall one as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n'
    )
    call = (
        '<think>\ncall it\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    wanted = expected(
        tokenizer,
        (system + turn("user", "Paris?") + "<|im_start|>assistant\n", 0),
        (call + "<|im_end|>", 1),
        ("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
        ("<think>\ndone\n</think>\n\nSunny.<|im_end|>", 1),
        ("\n", 0),
    )
    assert [shown(tokenizer, s) for s in samples] == [shown(tokenizer, wanted)]
    assert samples == [wanted]


def test_a_prefix_stable_conversation_stays_one_sample(tokenizer):
    """One user query then a tool round: nothing is rewritten, one sample (as before issue 34)."""
    assert len(tokenize_chat_samples(tokenizer, TOOL_CONVERSATION[:2], tools=[WEATHER])) == 1
    assert len(tokenize_chat_samples(tokenizer, THREE_TURNS[:3])) == 1


def test_the_data_checks_accept_tool_shapes_and_name_malformed_ones():
    assert conversation_problem(TOOL_CONVERSATION, "messages") is None
    bad = [
        (
            {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
            "only assistant",
        ),
        ({"role": "assistant", "content": None, "tool_calls": []}, "not a non-empty list"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
            "no function 'name'",
        ),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}, "no 'arguments'"),
        ({"role": "assistant", "content": None}, "no 'content'"),
        ({"role": "assistant", "content": "a", "reasoning_content": 3}, "'reasoning_content', not a string"),
        ({"role": "tool", "content": None}, "no 'content'"),
    ]
    for message, problem in bad:
        found = conversation_problem([{"role": "user", "content": "q"}, message], "messages")
        assert found is not None and problem in found and "\n" not in found, (message, found)
    rows = datasets.Dataset.from_dict({"messages": [TOOL_CONVERSATION] * 2, "tools": [json.dumps([WEATHER]), "[1]"]})
    with pytest.raises(ValueError, match=r"^dataset d row 1: 'tools' item 0 is not a function schema"):
        check_chat_columns(rows, "d")
    thinking = datasets.Dataset.from_dict({"messages": [TOOL_CONVERSATION], "enable_thinking": ["yes"]})
    with pytest.raises(ValueError, match=r"^dataset d row 0: 'enable_thinking' is 'yes', not true, false or null"):
        check_chat_columns(thinking, "d")


def test_the_dataset_map_returns_every_sample_and_records_the_switch(tokenizer):
    """The batched map gives a conversation as many rows as it has samples; a share mixes
    thinking deterministically per conversation, and a row's own switch wins."""
    conversations = [[*THREE_TURNS[:1], {"role": "user", "content": f"q{i}"}, *THREE_TURNS[2:]] for i in range(40)]
    rows = datasets.Dataset.from_dict({"messages": conversations})
    tokens = tokenize_conversations(tokenizer, rows, thinking_share=0.5)
    switches = [conversation_thinking(c, None, 0.5) for c in conversations]
    assert 10 < sum(switches) < 30  # a share, not all or nothing
    assert len(tokens) == 3 * len(conversations)
    assert tokens["enable_thinking"] == [s for s in switches for _ in range(3)]
    on = switches.index(True)
    assert tokens[3 * on]["input_ids"] == tokenize_chat_samples(tokenizer, conversations[on], True)[0]["input_ids"]
    assert switches == [conversation_thinking(c, None, 0.5) for c in conversations]  # the same every time
    own = datasets.Dataset.from_dict({"messages": conversations[:2], "enable_thinking": [False, None]})
    assert tokenize_conversations(tokenizer, own, thinking_share=1.0)["enable_thinking"] == [False] * 3 + [True] * 3
    tools = datasets.Dataset.from_dict({"messages": [TOOL_CONVERSATION], "tools": [json.dumps([WEATHER])]})
    assert tokenize_conversations(tokenizer, tools)["input_ids"] == [
        tokenize_chat_samples(tokenizer, TOOL_CONVERSATION, tools=[WEATHER])[0]["input_ids"]
    ]


def test_thinking_share_is_checked_and_part_of_the_resume_identity(tmp_path):
    from trainer.data.dataset import check_sample_counts
    from trainer.training.arguments import DataArguments, parse_arguments
    from trainer.training.resume_check import changed_fields

    recipe = tmp_path / "recipe.yaml"
    for value, words in (("1.5", "thinking_share must be"), ("yes", "thinking_share")):
        recipe.write_text(f"target: t\ndraft_config: d.json\noutput_dir: {tmp_path / 'out'}\nthinking_share: {value}\n")
        with pytest.raises(ValueError) as refused:
            parse_arguments([str(recipe)])
        assert words in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=r"^thinking_share=0.5 and enable_thinking=True are both set"):
        check_sample_counts(DataArguments(thinking_share=0.5, enable_thinking=True))
    old = {"data_arguments": {"thinking_share": None}}
    assert changed_fields(old, {"data_arguments": {"thinking_share": 0.5}}) == [("thinking_share", None, 0.5)]


def test_the_rehearsal_data_check_counts_every_sample_of_a_rewritten_conversation(tokenizer, tmp_path):
    """`dflash2 rehearse` renders the first conversation as training will: a Qwen3-like template makes
    three samples of THREE_TURNS (one per user query), all supervised, where one sample would be refused."""
    from trainer.rehearsal.run import Rehearsal

    tokenizer.save_pretrained(tmp_path / "target")
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": THREE_TURNS}) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"target: {tmp_path / 'target'}\ndataset: {data}\nregenerate: false\n")
    rehearsal = Rehearsal.__new__(Rehearsal)
    rehearsal.workspace, rehearsal.rehearsal_recipe = tmp_path, recipe
    samples = tokenize_chat_samples(tokenizer, THREE_TURNS)
    tokens = sum(len(sample["input_ids"]) for sample in samples)
    supervised = sum(sum(sample["loss_mask"]) for sample in samples)
    assert len(samples) == 3
    assert rehearsal.data_check() == (
        f"1 rows; the chat template renders the first: 3 samples of {tokens} tokens, {supervised} supervised"
    )

"""The model card quotes every value for where it lands, even a name no entry point would accept."""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from trainer.publishing.contract import TargetDimensions
from trainer.publishing.model_card import TAGS, render_model_card

CONFIG = json.loads((Path(__file__).resolve().parents[3] / "hub_configs" / "smollm2-135m-dflash2.json").read_text())
HOSTILE = [
    "org/x\n---\nlicense: evil\n---\n# pwned",
    "org/x\n```\n# out of the code block\n```bash",
    "$(touch /tmp/dflash2-card-x)",
    "org/`touch /tmp/dflash2-card-y`",
    'it\'s "quoted"; rm -rf ~ && echo \\',
    "org/x')\nimport os; os.system('id')  #",
    "<script>alert(1)</script> [link](http://evil) *bold* | table |",
]


def _card(name: str, training: dict | None = None) -> str:
    target = TargetDimensions(name=name, hidden_size=576, vocab_size=49152, num_layers=30)
    return str(render_model_card(CONFIG, target, {"training_arguments": training or {}}, {}, None))


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card[4:].split("\n---\n", 1)[0])


def _split(card: str) -> tuple[list[str], dict[str, list[str]]]:
    """(Markdown lines outside code blocks, code blocks by language), fences read as CommonMark
    does: a block closes only at a line of at least as many backticks as opened it."""
    prose: list[str] = []
    blocks: dict[str, list[str]] = {}
    fence, language, lines = "", "", []
    for line in card.split("\n"):
        if not fence and (opening := re.match(r"(`{3,})(\w*)$", line)):
            fence, language, lines = opening.group(1), opening.group(2), []
        elif fence and re.fullmatch(rf"{fence}`*", line):
            blocks.setdefault(language, []).append("\n".join(lines))
            fence = ""
        elif fence:
            lines.append(line)
        else:
            prose.append(line)
    assert not fence, "a code block is never closed"
    return prose, blocks


def _blocks(card: str, language: str) -> list[str]:
    return _split(card)[1][language]


def _argv(block: str) -> list[str]:
    return shlex.split(block.replace("\\\n", " "))  # the shell joins continued lines


def expected_metadata(base_model: str | None) -> dict:
    metadata = {
        "library_name": "transformers",
        "license": "apache-2.0",
        "pipeline_tag": "text-generation",
        "tags": TAGS,
    }
    return metadata if base_model is None else {"base_model": base_model, **metadata}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_target_name_stays_one_quoted_value_everywhere(name):
    card = _card(name)
    assert _front_matter(card) == expected_metadata(None)  # not a Hub id: never base_model
    prose, _ = _split(card)
    assert prose.count("---") == 2  # the front matter's own; no second one, no setext heading, no rule

    heading = next(line for line in card.splitlines() if line.startswith("# DFlash2 draft for "))
    assert not re.search(r"(?<!\\)[`<>\[\]*|$]", heading.removeprefix("# DFlash2 draft for ")), heading

    vllm, sglang = _blocks(card, "bash")
    block = CONFIG["dflash_config"]["block_size"]
    speculative = json.dumps({"method": "dflash", "model": "<this repo>", "num_speculative_tokens": block - 1})
    assert _argv(vllm) == ["vllm", "serve", name, "--speculative-config", speculative]
    assert _argv(sglang) == [
        *("python", "-m", "sglang.launch_server", "--model-path", name, "--speculative-algorithm", "DFLASH"),
        *("--speculative-draft-model-path", "<this repo>", "--speculative-num-draft-tokens", str(block)),
    ]

    (snippet,) = _blocks(card, "python")
    calls = [node for node in ast.walk(ast.parse(snippet)) if isinstance(node, ast.Call)]
    loads = [call for call in calls if getattr(call.func, "attr", None) == "from_pretrained"]
    arguments = [call.args[0] for call in sorted(loads, key=lambda call: call.lineno)]
    assert all(isinstance(argument, ast.Constant) for argument in arguments)
    assert [argument.value for argument in arguments] == ["<this repo>", name, name]
    nodes = list(ast.walk(ast.parse(snippet)))
    imports = [alias.name for node in nodes if isinstance(node, ast.ImportFrom) for alias in node.names]
    assert imports == ["AutoModel", "AutoModelForCausalLM", "AutoTokenizer"]  # nothing the name smuggled in
    assert not any(isinstance(node, ast.Import) for node in nodes)


def test_a_hub_id_is_the_base_model_and_appears_as_written():
    card = _card("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert _front_matter(card) == expected_metadata("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "# DFlash2 draft for HuggingFaceTB/SmolLM2-135M-Instruct\n" in card
    assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct \\\n" in card
    assert 'AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")' in card
    # the placeholder is one quoted word too (unquoted, `<this repo>` is a shell redirection)
    assert _argv(_blocks(card, "bash")[1])[-4:] == [
        *("--speculative-draft-model-path", "<this repo>", "--speculative-num-draft-tokens", "8")
    ]


@pytest.mark.parametrize("name", ["~/models/target", "runs/my/target", "models/target.gguf", "org/a--b"])
def test_a_local_path_or_a_name_the_hub_refuses_is_never_the_base_model(name):
    card = _card(name)
    assert _front_matter(card) == expected_metadata(None)
    assert _argv(_blocks(card, "bash")[0])[2] == name


def test_recipe_values_from_someone_elses_checkpoint_stay_inert_prose():
    training = {
        "learning_rate": "1\n---\n# injected",
        "loss_type": "ce` <img src=x onerror=alert(1)> `",
        "kd_weight": "heavy",
        "selector_alpha": "[x](http://evil)",
    }
    card = _card("org/target", training)
    assert _front_matter(card) == expected_metadata("org/target")
    assert _split(card)[0].count("---") == 2 and "\n# injected" not in card
    section = card.split("## Training\n", 1)[1].split("## Evaluation", 1)[0]
    assert not re.search(r"(?<!\\)<img|(?<!\\)\]\(http", section)  # no live tag, no live link
    assert "\\<img src=x onerror=alert\\(1\\)\\>" in section and "\\[x\\]\\(http://evil\\)" in section


@pytest.mark.parametrize(("block", "vllm_tokens", "sglang_tokens"), [(8, 7, 8), (16, 15, 16)])
def test_the_serving_commands_draft_exactly_the_trained_block(block, vllm_tokens, sglang_tokens):
    """vLLM takes the convolution block from 1 + num_speculative_tokens, so a card that printed the
    config's block size (or anything but B - 1) would serve shifted blocks without an error."""
    config = {**CONFIG, "dflash_config": {**CONFIG["dflash_config"], "block_size": block}}
    target = TargetDimensions(name="org/target", hidden_size=576, vocab_size=49152, num_layers=30)
    card = str(render_model_card(config, target, {"training_arguments": {}}, {}, None))
    vllm, sglang = (_argv(command) for command in _blocks(card, "bash"))
    assert json.loads(vllm[vllm.index("--speculative-config") + 1])["num_speculative_tokens"] == vllm_tokens
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == str(sglang_tokens)
    prose = " ".join(" ".join(_split(card)[0]).split())
    assert (
        f"vLLM's `num_speculative_tokens` must be exactly B − 1 = {vllm_tokens} and SGLang's "
        f"`--speculative-num-draft-tokens` exactly B = {sglang_tokens}, because vLLM takes the draft's "
        "convolution block from 1 + `num_speculative_tokens`, not from the config's `block_size`"
    ) in prose

"""One home per rule: the shipped config module decides what a config alone decides, the contract
numbers that verdict and adds only publish-only rules, one pair check serves training, planning and
export, and one bounds table serves the config and the size bounds."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from modeling_dflash2 import DFlash2Config
from modeling_dflash2 import configuration_dflash2 as configuration
from modeling_dflash2.configuration_dflash2 import FIELD_BOUNDS, DFlashConfigError
from tests.support.drafts import tiny_config_kwargs, tiny_dflash_config
from tests.support.tiny_target import tiny_draft_config_for, tiny_target
from trainer.models.config_bounds import bounds_violations
from trainer.models.pairing import TargetDimensions
from trainer.plan.facts import check_pair, draft_facts, target_facts
from trainer.publishing import contract
from trainer.publishing.contract import config_violations, public_config

REPO = Path(__file__).resolve().parents[3]
SOURCES = sorted((REPO / "trainer").rglob("*.py")) + sorted((REPO / "modeling_dflash2").glob("*.py"))
TARGET = TargetDimensions("org/tiny", hidden_size=32, vocab_size=50, num_layers=6)


def _definitions(name: str) -> list[str]:
    """Every module-level function called `name` in the shipped and trainer code."""
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        found += [
            str(path.relative_to(REPO)) for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name
        ]
    return found


def _public(**edits) -> dict:
    """The tiny draft's config.json as the export writes it, with `edits` applied."""
    public = public_config(DFlash2Config(**tiny_config_kwargs()), torch.bfloat16)
    for key, value in edits.items():
        if key in tiny_dflash_config():
            public["dflash_config"][key] = value
        else:
            public[key] = value
    return public


# -- one implementation of each helper ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "home"),
    [
        (("is_int", "_is_int"), "modeling_dflash2/configuration_dflash2.py"),
        (("format_bytes",), "trainer/fileio.py"),
        (("read_json_object", "read_config_file", "_read_config_file"), "trainer/fileio.py"),
        (("pair_violations", "check_draft_pair"), "trainer/models/pairing.py"),
    ],
)
def test_each_helper_has_one_implementation(names, home):
    assert [path for name in names for path in _definitions(name)] == [home]


def test_models_never_import_publishing():
    for path in sorted((REPO / "trainer" / "models").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("trainer.publishing"), f"{path.name}: {node.module}"


def test_the_shipped_config_module_imports_only_torch_transformers_and_siblings():
    tree = ast.parse(Path(configuration.__file__).read_text())
    for node in ast.walk(tree):
        modules = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level == 0
            else []
        )
        for module in modules:
            top = module.split(".")[0]
            assert top in {
                "torch",
                "transformers",
                "__future__",
                "collections",
                "dataclasses",
                "logging",
                "math",
                "typing",
            }


def test_every_publish_only_rule_says_why_it_is_stricter():
    rules = [function for name, function in vars(contract).items() if name.startswith("_rule_")]
    assert len(rules) >= 6
    for function in rules:
        assert "# stricter than the config" in inspect.getsource(function), function.__name__


# -- one bounds table: the config, the size bounds and the contract agree at every edge -------------------


BOUNDED = [
    ("dflash_config.block_size", {"conv_kernel_size": 1}),
    ("dflash_config.conv_kernel_size", {}),
    ("dflash_config.selector_rank", {}),
    ("dflash_config.selector_top_k", {}),
    ("dflash_config.mask_token_id", {}),
]


@pytest.mark.parametrize(("field", "others"), BOUNDED)
def test_the_lowest_value_is_the_same_in_config_size_bounds_and_contract(field, others):
    name, low = field.removeprefix("dflash_config."), FIELD_BOUNDS[field].low
    for value, valid in ((low, True), (low - 1, False)):
        dflash = tiny_dflash_config(**{**others, name: value})
        try:
            DFlash2Config(**tiny_config_kwargs(dflash_config=dflash))
            config_ok = True
        except DFlashConfigError as error:
            config_ok = False
            assert error.field == field
        assert config_ok is valid, (field, value)
        raw = tiny_config_kwargs(dflash_config=dflash)
        if FIELD_BOUNDS[field].cap is not None:
            assert (not any(field in failure for failure in bounds_violations(raw))) is valid, (field, value)
        contract_failures = config_violations(_public(**others, **{name: value}), TARGET)
        assert (not contract_failures) is valid, (field, value, contract_failures)


def test_the_contract_numbers_the_configs_own_verdict_in_its_words():
    for edit, rule in (
        ({"selector_top_k": 51}, 8),
        ({"mask_token_id": 50}, 9),
        ({"conv_kernel_size": 5}, 7),
        ({"hidden_act": "gelu"}, 12),
        ({"attention_mode": "mla"}, 4),
        ({"output_multiplier": 0.0}, 11),
    ):
        public = _public(**edit)
        with pytest.raises(DFlashConfigError) as refused:
            DFlash2Config(**public)
        error = refused.value
        expected = (
            f"rule {rule}: {error.field.removeprefix('dflash_config.')} {error.requirement} (got {error.value!r})"
        )
        assert config_violations(public, TARGET) == [expected], edit


# -- one pair check: the same verdict in training, planning and export -----------------------------------


PAIR_MISMATCHES = [
    pytest.param(
        {"hidden_size": 64, "intermediate_size": 64},
        None,
        12,
        "hidden_size 64 != the target's hidden size 32",
        id="hidden",
    ),
    pytest.param(
        {"vocab_size": 40}, {"mask_token_id": 3}, 13, "vocab_size 40 != the target's padded vocab", id="vocab"
    ),
    pytest.param({"num_target_layers": 6}, None, 10, "num_target_layers 6 != the target's depth 4", id="depth"),
    pytest.param(
        {"num_target_layers": 8},
        {"target_layer_ids": [1, 5]},
        10,
        "reach past the target's 4 layers: [5]",
        id="layer-ids",
    ),
]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize(("overrides", "dflash", "rule", "message"), PAIR_MISMATCHES)
def test_a_pair_gets_the_same_verdict_in_training_planning_and_export(target, overrides, dflash, rule, message):
    config = tiny_draft_config_for(target, dflash, **overrides)
    with pytest.raises(ValueError) as training:
        target.check_draft(config.dflash_settings, config)
    with pytest.raises(ValueError) as planning:
        check_pair(draft_facts(config), target_facts(target.model.config), "tiny")
    export = config_violations(public_config(config, torch.bfloat16), target.dimensions())
    assert message in str(training.value) and message in str(planning.value)
    assert any(failure.startswith(f"rule {rule}: ") and message in failure for failure in export), export
    training_reasons = str(training.value).split(": ", 1)[1]
    planning_reasons = str(planning.value).split(": ", 1)[1]
    assert training_reasons == planning_reasons  # the same list, in the same words


def test_a_fitting_pair_passes_everywhere(target):
    config = tiny_draft_config_for(target)
    target.check_draft(config.dflash_settings, config)
    check_pair(draft_facts(config), target_facts(target.model.config), "tiny")
    assert config_violations(public_config(config, torch.bfloat16), target.dimensions()) == []


# -- resolved once, cached, never re-validated by a property ------------------------------------------------


def test_properties_read_the_cached_settings_and_a_replaced_field_is_validated_again(monkeypatch):
    config = DFlash2Config(**tiny_config_kwargs())
    calls = []
    resolve = configuration._resolve
    monkeypatch.setattr(configuration, "_resolve", lambda values: calls.append(1) or resolve(values))
    for _ in range(3):
        assert (config.block_size, config.selector_top_k, config.target_layer_ids) == (4, 5, [1, 4])
    assert config.dflash_settings is config.dflash_settings and calls == []
    config.dflash_config = tiny_dflash_config(selector_top_k=1)
    with pytest.raises(DFlashConfigError, match="selector_top_k"):
        config.block_size  # noqa: B018
    assert "_dflash_settings" not in config.to_dict()
    assert DFlash2Config(**tiny_config_kwargs()) == DFlash2Config(**tiny_config_kwargs())

"""Shared by the feature-store tests: a tiny target, its tokenized conversations, a small store of
them, and reading every sample back (module-scoped fixtures: import them into the test module)."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from tests.support.tiny_target import tiny_conversations, tiny_target
from trainer.data.chat import tokenize_chat
from trainer.data.feature_store import FeatureStoreError, OfflineDataset, prepare_features


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def token_dataset(target, count: int = 5) -> datasets.Dataset:
    conversations = datasets.Dataset.from_dict({"messages": tiny_conversations(count)})
    return conversations.map(lambda s: tokenize_chat(target.tokenizer, s["messages"]), remove_columns=["messages"])


@pytest.fixture(scope="module")
def tokens(target):
    return token_dataset(target)


def store(target, tokens, root: Path, **kwargs) -> Path:
    """Features of layers [2, 1] in shards of 2 samples, captured 2 at a time."""
    return prepare_features(target, tokens, [2, 1], root, batch_size=2, shard_samples=2, **kwargs)


def read_all(dataset: OfflineDataset) -> None:
    for index in range(len(dataset)):
        dataset[index]


def refusal(dataset: OfflineDataset, index: int) -> str:
    """The one-line refusal of sample `index`."""
    with pytest.raises(FeatureStoreError) as caught:
        dataset[index]
    return str(caught.value)

"""Target features streamed from vLLM servers while training (`feature_endpoint` with `offline:
false`): no feature store; the training processes hold only the target's embedding and LM head."""

from __future__ import annotations


def streams_engine_features(data_args) -> bool:
    """Whether a run's features come from `feature_endpoint` while it trains (`offline: false`): the
    training processes then never run, nor load, the target's decoder layers."""
    return bool(data_args.feature_endpoint) and not data_args.offline

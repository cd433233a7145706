"""Whether the Hugging Face Hub answers from here, decided once with a short deadline.

Unreachable, every library retries each file for about 25 s before giving up; a rehearsal reads
several (the target's config and tokenizer, the dataset), so it asks once and, when the Hub does not
answer, works offline from then on: the Hugging Face cache alone, for this process and the ranks it
launches (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import os

PROBE_TIMEOUT_S = 5.0


def hub_reachable(timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """One HEAD request to the Hub's endpoint (HF_ENDPOINT), proxies as configured; False when offline
    mode is already set."""
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return False
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s)
    except Exception:  # any failure to connect means: not reachable from here
        return False
    return True


def go_offline() -> None:
    """Offline mode for this process (huggingface_hub and datasets read the flag at import) and for
    every process it starts."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    try:
        import datasets.config
    except ImportError:
        return
    datasets.config.HF_HUB_OFFLINE = True

"""Real speculative decoding measured: acceptance reports, the tau gap, the prompt sets."""

"""Real serving engines for the engine tests and benchmarks (`make test-engines`): starting a vLLM
server from its own virtualenv, and the vLLM plugin of the CPU-only adjustments."""

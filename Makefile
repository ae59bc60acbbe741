# The README's two commands: `make bench` (set up + run the benchmark) and `make test` (set up + tests).
PY ?= python3

.PHONY: setup setup-test test bench lint

# A machine that already has torch (a GPU box with its CUDA build) keeps it; others get the CPU
# wheel. Offline GPU boxes: see the README's install section.
setup:
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[bench]'

# Tests: Debian's redis-server (the `redis` tests start their own clusters), vLLM 0.32.0 with
# the CPU torch 2.13.0; its torchvision/torchaudio/torchcodec are CUDA builds
# that break `import transformers` on a CPU machine, so they go.
setup-test:
	bash .ci/install-redis
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q vllm==0.32.0
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q -e '.[test,bench,dev]'

lint:
	$(PY) -m ruff check .

test: setup-test lint
	$(PY) -m pytest

bench: setup
	kvconnector bench

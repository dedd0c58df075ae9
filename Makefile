# kvedge: `make demo` sets up and runs the main job on the built-in model; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; override on a GPU machine, e.g. `make setup TORCH=torch`.
TORCH  ?= torch==2.13.0

.PHONY: setup demo test tensorrt clean

setup: $(VENV)/.kvedge-setup

$(VENV)/.kvedge-setup: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: setup
	$(BIN)/kvedge demo

test: setup
	$(BIN)/python -m pytest -q -n 2

# On a Jetson or GPU machine with TensorRT: build -> parity against torch -> bench (skips elsewhere).
tensorrt: setup
	$(BIN)/python -m pytest -v -rs tests/tensorrt -s

clean:
	rm -rf $(VENV) demo .pytest_cache

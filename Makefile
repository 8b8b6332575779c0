# The two quick-start commands: `make quickstart` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: setup quickstart test bench
setup: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/onnxpipe models build gpt2-tiny -o build/gpt2-tiny.onnx
	$(BIN)/onnxpipe split build/gpt2-tiny.onnx --target fpga4 --stages 4 -o build/gpt2-tiny-stages --force
	$(BIN)/onnxpipe verify build/gpt2-tiny-stages build/gpt2-tiny.onnx

test: $(STAMP)
	$(BIN)/python -m pytest

# Each target sets up its own virtualenv on a fresh clone (no network needed beyond the package index).
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of PyTorch; on a GPU machine point this at your CUDA build (e.g. TORCH=torch).
TORCH ?= torch==2.13.0

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/cca-convert examples/tiny-llama --recipe recipes/tiny-demo.yaml --output out/tiny-cca --overwrite

test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) out

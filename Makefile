# Each target sets up its own virtualenv on a fresh clone (no network needed beyond the package index).
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch requirement installed first. Which build it brings depends on the package index: PyPI's Linux wheel is the
# CUDA build; a CPU-only index (or a local CPU wheel) gives the CPU build: TORCH_INDEX picks the index for torch, e.g.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu; TORCH=torch takes any version on a GPU machine.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: demo demo-dca test test-oldest test-gpu test-multigpu clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[test]" $(EXTRA_PINS)
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/cca-convert examples/tiny-llama --recipe recipes/tiny-demo.yaml --output out/tiny-cca --overwrite

demo-dca: $(VENV)/.installed
	$(VENV)/bin/cca-convert examples/tiny-llama --recipe recipes/dca-tiny-demo.yaml --output out/tiny-dca --overwrite

# Two pytest-xdist workers: most CPU tests are single-threaded (the Triton interpreter, one torch thread each), so a
# two-core machine runs the suite in about half the time; TEST_WORKERS=0 runs it in one process. PYTEST_ARGS adds
# pytest options, e.g. PYTEST_ARGS='-m "not slow"' leaves out the end-to-end CLI runs of a minute or more.
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The same suite against the oldest versions pyproject.toml admits (those of the GPU image). triton 3.6's
# CPU interpreter turns loaded scalars into 1-element arrays, which NumPy >= 2.3 refuses as loop bounds. With
# triton 3.6 it also compiles the Hopper Gluon kernels and the DCA decode kernel for sm_90 without a GPU
# (tests/kernels/test_gluon_compiles.py).
OLDEST := transformers==5.17.0 huggingface_hub==1.33.0 triton==3.6.0 peft==0.21.0 safetensors==0.8.0 'numpy<2.3'
test-oldest:
	$(MAKE) test VENV=.venv-oldest TORCH="$(TORCH)" EXTRA_PINS="$(OLDEST)"

# On a CUDA machine, in the Python that has the CUDA build of torch (no virtualenv: GPU images ship their own
# torch): every gpu-marked test (kernels, model-level training parity, decode), then the quick fidelity run
# (CLI, Triton backend, micro-batch 4, real text; trains its 26M base first if out/fidelity-llama is missing).
# With pytest-xdist, PYTEST_ARGS="-n 8" runs it in ~12 min on one H100; tests/conftest.py hands
# each test's cached GPU memory back, so that eight workers fit on one card; more workers oversubscribe it. On several
# GPUs, TEST_GPUS=0,1,2,3 gives xdist worker k the GPU TEST_GPUS[k % n] of n (tests/conftest.py), e.g. PYTEST_ARGS="-n 8".
GPU_PY ?= python3
TEST_GPUS ?=
test-gpu:
	TEST_GPUS=$(TEST_GPUS) $(GPU_PY) -m pytest -q -p no:cacheprovider -m gpu tests $(PYTEST_ARGS)
	$(GPU_PY) benchmarks/fidelity.py --quick

# On a machine with 2+ CUDA GPUs (GPU_PY as above): the CLI under accelerate launch on 2 GPUs: FSDP full / qkv /
# LoRA and DDP on tiny Llama, Qwen3-MoE and Gemma 3 checkpoints, 1 vs 2 GPUs at the same global batch, kill -9 and
# --resume (~5 min on two H100s).
test-multigpu:
	$(GPU_PY) -m pytest -q -p no:cacheprovider -m multigpu tests -s $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-oldest out

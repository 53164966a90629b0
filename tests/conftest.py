import atexit
import gc
import os
import shutil
import tempfile

# Set before torch loads Inductor, so that xdist workers compiling the decode step's twins do not each start a pool of
# compile subprocesses (a full GPU run went past 600 s once the twins came in; 14 workers x 16 compilers).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Several GPUs (`make test-gpu TEST_GPUS=0,1,2,3 PYTEST_ARGS="-n 8"`): xdist worker k sees only GPU TEST_GPUS[k % n],
# set before torch first touches CUDA, so the workers spread over the GPUs instead of sharing the first one.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_GPUS = [g.strip() for g in os.environ.get("TEST_GPUS", "").split(",") if g.strip()]
if _WORKER.startswith("gw") and _GPUS:
    os.environ["CUDA_VISIBLE_DEVICES"] = _GPUS[int(_WORKER[2:]) % len(_GPUS)]
# xdist workers already fill the cores: the CLI runs they start (subprocesses) take one thread each too, instead of
# each starting a pool of all the cores that spins against the other workers (`make test` on two cores, two workers:
# real 64 min without this, a run that shared the machine with other work for ~10 min; 55 min with it, alone).
if _WORKER.startswith("gw"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Remote code loaded in this process (trust_remote_code) is copied into HF_MODULES_CACHE, which transformers reads once,
# at import: a folder of this process's own, so that tests write nothing into the user's ~/.cache and xdist workers
# loading exports of equal code (one hash, one folder) do not copy into each other's files while one imports them.
_MODULES = tempfile.mkdtemp(prefix="cca-test-modules-")
os.environ["HF_MODULES_CACHE"] = _MODULES
atexit.register(shutil.rmtree, _MODULES, ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support.hub_server import configure_hf_client, hub_server  # noqa: F401  (fixture for all tests)

# Small CPU tests: one thread each is faster than oversubscribing CI's two cores.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # The slow end-to-end tests (CLI runs of minutes) first: xdist (`make test` runs two workers) then starts them
    # while the many short tests fill the other worker, instead of leaving one to finish alone at the end.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_hf_client(tmp_path_factory, monkeypatch):
    """No test reads the user's Hugging Face cache or token, or reaches a real Hub: the client points
    at a closed local port unless a test starts the `hub_server` fixture (which re-points it)."""
    configure_hf_client(monkeypatch, "http://127.0.0.1:9", tmp_path_factory.mktemp("hf_home"), token=None)


@pytest.fixture(autouse=True)
def _return_gpu_memory():
    """xdist workers share one GPU, and each process's caching allocator keeps what its largest test reserved (the DCA
    kernel tests over 9K-50K keys reserve up to 27 GiB): handed back after every test, so that eight workers fit on
    one card. (``make test-gpu PYTEST_ARGS="-n 8"`` on an H200 ran out of memory in small models' tests without it:
    docs/test-runs/test-gpu-h200-memory.txt.)"""
    yield
    if torch.cuda.is_initialized():
        gc.collect()  # (tensors held in reference cycles, e.g. by a failed test's traceback)
        torch.cuda.empty_cache()

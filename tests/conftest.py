"""Test configuration: offline Hugging Face, Triton interpreter (or a GPU), deterministic torch.

Environment variables must be set before transformers / huggingface_hub / triton are imported,
so they are set here at collection time.
"""

import os
import tempfile

# POLAR_VIT_TEST_DEVICE=cuda (benchmarks/gpu_check.sh) runs the Triton tests on the GPU; otherwise
# the kernels run on CPU tensors in Triton's interpreter
if os.environ.get("POLAR_VIT_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="polar-vit-hf-home-"))
os.environ.setdefault("MPLBACKEND", "Agg")
# the compiled CPU kernels of the fused layers (inductor, a compile per process and kernel) stay off in the suite,
# where every test and subprocess trains for a few steps; tests/test_cpu_kernels.py turns them on and checks them
os.environ.setdefault("POLAR_VIT_CPU_KERNELS", "0")
# compiled kernels the tests make are kept for this test run only, not in the user's cache; the xdist workers of a
# run share them (one folder named for the run: a kernel one worker compiled, the others load; files are written
# atomically); tests that count compiles use a cache of their own
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
_kernels = os.path.join(tempfile.gettempdir(), f"polar-vit-kernels-{_run}") if _run else None
if _kernels:
    os.makedirs(_kernels, exist_ok=True)
os.environ.setdefault("POLAR_VIT_KERNEL_CACHE", _kernels or tempfile.mkdtemp(prefix="polar-vit-kernels-"))
# inductor's own caches (compiled graphs, C++ libraries) in one folder for every test, as inductor's default is:
# with none chosen, each kernel cache would get its own beside it (modeling/cpu_kernels.py), and the tests that use a
# kernel cache of their own would compile every C++ library again; the test of that folder unsets this
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "torchinductor-polar-vit-tests"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def traced_kernels(monkeypatch):
    """``traced_kernels(enabled)``: the options ``torch.compile`` traces with (read from the environment at import,
    so the kernels are off in this suite) get the compiled CPU kernels on or off; dynamo's caches are reset then and
    after the test."""
    import dataclasses

    from polar_vit_hf.modeling import runtime

    def set_traced(enabled: bool) -> None:
        monkeypatch.setattr(runtime, "_TRACED", dataclasses.replace(runtime._TRACED, cpu_kernels=enabled))
        torch._dynamo.reset()

    yield set_traced
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """A short pretraining run on the shipped digits data (4 steps), shared by the export and Hub tests."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("digits-run")
    command = [
        sys.executable,
        "-m",
        "polar_vit_hf.training.pretrain",
        "--output_dir",
        str(out),
        "--max_steps",
        "4",
        "--save_steps",
        "4",
        "--eval_steps",
        "4",
        "--batch_size",
        "16",
        "--no_progress",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def local_hub():
    """The local Hub server (tests/support/local_hub.py, test infrastructure) with one user and token."""
    from local_hub import TEST_TOKEN, TEST_USER, LocalHub

    with LocalHub(tokens={TEST_TOKEN: TEST_USER}) as hub:
        yield hub

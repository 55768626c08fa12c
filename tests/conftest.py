"""Test configuration: offline Hugging Face, Triton interpreter, deterministic torch.

Environment variables must be set before transformers / huggingface_hub / triton are imported,
so they are set here at collection time.
"""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU tensors
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="polar-vit-hf-home-"))
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

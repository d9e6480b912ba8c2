import contextlib
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Triton fixes interpreter-or-compiler when it is first imported. Without a GPU, import it now in interpreter
# mode, before any other test module (transformers, torch._dynamo) imports it; then drop the variable so the
# dispatchers use the eager twins except in tests/kernels, which set it again around their own tests.
if not torch.cuda.is_available():
    _prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401
    if _prev is None:
        os.environ.pop("TRITON_INTERPRET", None)


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)


@pytest.fixture(params=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def device(request):
    return torch.device(request.param)

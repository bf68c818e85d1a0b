import os
from pathlib import Path

import pytest
import torch

from turbo.testing import make_install, make_spec_install

# Subprocesses (python -m turbo ..., run from a temporary directory) import the checkout under
# test, not whichever one the environment's editable install points at.
ROOT = Path(__file__).resolve().parents[1]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

# Tiny models: intra-op threads only add barrier waits, and on a shared machine they can
# stall badly. One thread also keeps the timing-free tests fast and steady.
torch.set_num_threads(1)

# Subprocesses (python -m turbo ... with another cwd) import this checkout's turbo, not whichever
# an editable install points at: the files the tests write and the code that reads them agree.
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.fixture(scope="session")
def spec_install(tmp_path_factory):
    """A random trunk (4 layers, 3 linear : 1 full) with a random DFlash2 drafter."""
    model, path = make_spec_install(tmp_path_factory.mktemp("spec"), 0)
    return model, path


@pytest.fixture(scope="session")
def plain_install(tmp_path_factory):
    """A random trunk without a drafter."""
    model, path = make_install(tmp_path_factory.mktemp("plain"), 1)
    return model, path


@pytest.fixture(scope="module", params=["native", "torch"])
def step_path(request):
    """Runs a module's tests on both CPU steps: native.c (the default) and the torch ops
    (what runs where no C compiler is, and the reference the CUDA kernels follow)."""
    from turbo.backends import native_lib

    with pytest.MonkeyPatch.context() as mp:
        if request.param == "torch":
            mp.setenv("TURBO_NATIVE", "0")
        elif native_lib.library() is None:
            pytest.skip(f"native step unavailable: {native_lib.why_not()}")
        yield request.param

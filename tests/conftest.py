import os
from pathlib import Path
from types import SimpleNamespace

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


@pytest.fixture(scope="module")
def tiny_server():
    """The server in process on the shipped tiny install: its worker.Engine (scheduler running),
    fastapi's TestClient over the app, and the official `openai` client through that."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from turbo.sequence.options import GenerationOptions, OpenOptions
    from turbo.serve.app import make_app
    from turbo.serve.settings import ServeConfig, server_defaults
    from turbo.serve.worker import Engine

    engine = Engine("tiny", OpenOptions(backend="cpu", threads=1), server_defaults(GenerationOptions()), ServeConfig())
    engine.start()
    http = TestClient(make_app(engine))
    try:
        yield SimpleNamespace(engine=engine, http=http, client=openai.OpenAI(
            base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=http))
    finally:
        engine.stop()


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


@pytest.fixture
def exact_bf16():
    """The bf16 matrices' exact fp32 walk (TURBO_BF16_PRODUCTS=exact) for one test, where the
    native library would take them through AMX otherwise (native_amx.c, bf16_products)."""
    from turbo.backends import native_lib
    lib = native_lib.library()
    if lib is None:
        yield
        return
    before = lib.bf16_products(-1)
    lib.bf16_products(0)
    yield
    lib.bf16_products(before)


@pytest.fixture(scope="session")
def host_device(tmp_path_factory):
    """The CUDA kernels' C on the simulated device (turbo.testing.host_cuda.HostDevice: one
    device per session, shared by the CUDA step's tests)."""
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    from turbo.testing.host_cuda import HostDevice

    return HostDevice()

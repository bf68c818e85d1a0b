"""The CUDA step (turbo/backends/cuda_step) end to end on the simulated device: its kernels' CUDA C
built for the host and run on fibers (turbo.testing.host_cuda.HostDevice, turbo/backends/cuda_sim), every buffer
allocated through the device interface cuda_kernels.Kernels has on a GPU. Against the CPU
native step: the same greedy tokens (the products sum in another order, so logits agree to
fp32 tolerance, not bit for bit); and on its own numerics: a verify's rows equal decode steps
bit for bit, and a checkpoint rollback leaves the state the kept rows' steps leave.
DEVICE-UNVERIFIED: no GPU has run this step yet."""

from __future__ import annotations

import ctypes

import pytest
import torch

from turbo.backends import native_lib
from turbo.backends.cuda_step.step import CudaTrunkStep
from turbo.load.loader import load_trunk
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def small(tmp_path_factory, host_device):
    """A 2-layer install (one Gated DeltaNet layer, one attention layer), bf16 matrices."""
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    from turbo.testing import make_install

    tmp = tmp_path_factory.mktemp("cuda_step")
    _, path = make_install(tmp, 3, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                           linear_key_head_dim=16, linear_value_head_dim=16)
    trunk = load_trunk(open_install(path), OpenOptions(dtype="bfloat16", kv_cache="float32"), "cpu")
    return trunk, CudaTrunkStep(trunk, host_device, capacity=32), host_device


def test_step_decodes_the_cpu_steps_tokens(small):
    trunk, cs, dev = small
    prompt = [5, 17, 99, 3, 250]
    a, b = trunk.new_state(32), trunk.new_state(32)
    ra, rb = trunk.prefill(a, prompt), cs.prefill(b, prompt, (), False)
    for _ in range(4):
        torch.testing.assert_close(rb.logits, ra.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rb.hidden[-1:], ra.hidden[-1:], rtol=1e-4, atol=1e-4)
        tok = int(ra.logits[-1].argmax())
        assert int(rb.logits[-1].argmax()) == tok
        ra, rb = trunk.step(a, [tok], (), None), cs.step(b, [tok], (), None)
    assert a.pos == b.pos == len(prompt) + 4
    launches = dev.launches[-(8 * 2 + 3):]  # one decode step: embed, 8 a layer, final norm, lm_head
    assert launches[0] == "embed_rows_bf16_f32" and launches[-1].startswith("bf16_rows_gemv_r1")
    assert launches[1:9] == ["add_rms_norm_f32", "bf16_rows_gemv_r1_f32", "gdn_step_ind_f32", "bf16_rows_gemv_r1_f32",
                             "add_rms_norm_f32", "bf16_rows_gemv_r1_f32", "silu_mul_f32", "bf16_rows_gemv_r1_f32"]
    assert launches[11] == "attn_rows_ind_f32"


def test_verify_rows_equal_decode_steps_and_checkpoint_rollback(small):
    trunk, cs, _ = small
    prompt, block = [7, 8, 9], [40, 41, 42, 43]
    a, b = trunk.new_state(32), trunk.new_state(32)
    cs.prefill(a, prompt, (), False), cs.prefill(b, prompt, (), False)
    one = [cs.step(a, [t], (), None) for t in block]
    snap = trunk.snapshot(b)
    ver = cs.step(b, block, (), "checkpoint")
    assert torch.equal(ver.logits, torch.cat([o.logits for o in one]))
    assert torch.equal(ver.hidden, torch.cat([o.hidden for o in one]))
    # keep 2 of the 4 rows: the next step equals the one after two decode steps
    trunk.rollback(b, ver, 4, 2, "checkpoint")
    c = trunk.new_state(32)
    cs.prefill(c, prompt, (), False)
    for t in block[:2]:
        cs.step(c, [t], (), None)
    assert torch.equal(cs.step(b, [99], (), None).logits, cs.step(c, [99], (), None).logits)
    # and back to the snapshot (a device copy): the verify's first row again
    trunk.restore(b, snap)
    assert torch.equal(cs.step(b, [block[0]], (), None).logits, one[0].logits)


def test_a_prefill_past_a_launch_and_aux_rows(small):
    """17 prompt rows go as launches of 16 and 1 (each row a step: test_verify_rows_equal_decode_steps...):
    logits, hidden rows and the aux layers' rows (the layers' outputs) are the CPU step's to 1e-4."""
    trunk, cs, _ = small
    prompt = [(13 * i) % 300 + 3 for i in range(17)]
    a, c = trunk.new_state(32), trunk.new_state(32)
    pre = cs.prefill(a, prompt, (0,), False)
    want = trunk.prefill(c, prompt, (0,), False)
    assert a.pos == 17 and pre.logits.shape == want.logits.shape and pre.aux.shape == want.aux.shape
    for got, ref in ((pre.logits, want.logits), (pre.hidden, want.hidden), (pre.aux, want.aux)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def small_moe(tmp_path_factory, host_device):
    """The MoE shape's two layers (Gated DeltaNet, attention; both routed: 8 experts, top 2, a
    gated shared expert), bf16."""
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    from turbo.testing import make_moe_install

    tmp = tmp_path_factory.mktemp("cuda_step_moe")
    _, path = make_moe_install(tmp, 4, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    trunk = load_trunk(open_install(path), OpenOptions(dtype="bfloat16", kv_cache="float32"), "cpu")
    return trunk, CudaTrunkStep(trunk, host_device, capacity=32)


def test_moe_step_decodes_the_cpu_steps_tokens_and_rows_equal_steps(small_moe):
    trunk, cs = small_moe
    assert all(layer.moe is not None for layer in trunk.layers)
    prompt = [5, 17, 99, 3]
    a, b = trunk.new_state(32), trunk.new_state(32)
    ra, rb = trunk.prefill(a, prompt, (), True), cs.prefill(b, prompt, (), True)
    torch.testing.assert_close(rb.logits, ra.logits, rtol=1e-4, atol=1e-4)
    toks = []
    for _ in range(2):
        tok = int(ra.logits[-1].argmax())
        assert int(rb.logits[-1].argmax()) == tok
        toks.append(tok)
        ra, rb = trunk.step(a, [tok], (), None), cs.step(b, [tok], (), None)
        torch.testing.assert_close(rb.logits, ra.logits, rtol=1e-4, atol=1e-4)
    # the prompt's rows in one launch equal its rows as decode steps (routing and sums per row)
    c = trunk.new_state(32)
    steps = [cs.step(c, [t], (), None) for t in prompt]
    assert torch.equal(torch.cat([s.logits for s in steps]), cs.prefill(trunk.new_state(32), prompt, (), True).logits)


def test_turbo_cuda_step_selects_the_step_for_the_trunk(monkeypatch, host_device, tmp_path):
    """TURBO_CUDA_STEP=1: load_trunk on the host hands the trunk to CudaTrunkStep over device 0's
    loader (here the host device standing in for cuda_kernels.Kernels)."""
    from turbo.backends import cuda_kernels
    from turbo.load import loader

    monkeypatch.setenv(loader.CUDA_STEP_ENV, "1")
    monkeypatch.setattr(cuda_kernels, "kernels", lambda device=None: host_device)
    trunk = load_trunk(open_install("tiny"), OpenOptions(kv_cache="float32"), "cpu")
    assert trunk.step_name == "cuda" and isinstance(trunk.stepper, CudaTrunkStep)


class _RowsDependentProducts:
    """Negative control: the host device, but every bf16 product of more than one row summed by
    torch (another order) instead of the kernel: a product whose reduction order depends on R."""

    def __init__(self, dev):
        self.dev = dev

    def launch(self, module, kernel, grid, block, args, shared=0, stream=None):
        if kernel.startswith("bf16_rows_gemv") and args[3].value > 1:
            R, n_in, n_out = args[3].value, args[4].value, args[5].value
            x = torch.frombuffer((ctypes.c_float * (R * n_in)).from_address(args[0].value), dtype=torch.float32)
            raw = (ctypes.c_int16 * (n_out * n_in)).from_address(args[1].value)
            w = (torch.frombuffer(raw, dtype=torch.int16).int() << 16).view(torch.float32).view(n_out, n_in)
            y = torch.frombuffer((ctypes.c_float * (R * n_out)).from_address(args[2].value), dtype=torch.float32)
            y.copy_((x.view(R, n_in).double() @ w.double().T).float().reshape(-1))
            return
        self.dev.launch(module, kernel, grid, block, args, shared, stream)

    def __getattr__(self, name):
        return getattr(self.dev, name)


def test_rows_check_catches_a_row_count_dependent_product(small):
    """The verify == decode steps check of test_verify_rows_equal_decode_steps... fails on a step
    whose products sum in an order that depends on the row count."""
    trunk, _, dev = small
    bad = CudaTrunkStep(trunk, _RowsDependentProducts(dev), capacity=32)
    a, b = trunk.new_state(32), trunk.new_state(32)
    bad.prefill(a, [7, 8], (), False), bad.prefill(b, [7, 8], (), False)
    one = torch.cat([bad.step(a, [t], (), None).logits for t in (40, 41)])
    assert not torch.equal(bad.step(b, [40, 41], (), "checkpoint").logits, one)
    bad.close()


def test_int4_install_decodes_the_torch_steps_tokens(tmp_path, host_device):
    """An int4 install (repack --quant int4), its matrices resident packed (int4 words, bf16 scales):
    the torch step's tokens (its dequantized fp32 products: the same function; the native step's
    int4 products round their inputs to 8 bits)."""
    from turbo.repack import repack
    from turbo.testing import make_checkpoint

    make_checkpoint(tmp_path / "hf", 5, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                    linear_key_head_dim=16, linear_value_head_dim=16, hidden_size=64, intermediate_size=128)
    from safetensors.torch import load_file, save_file

    st = tmp_path / "hf" / "model.safetensors"  # every weight a bf16 value: the fp32 embedding is a bf16 one
    save_file({k: v.to(torch.bfloat16).float() for k, v in load_file(st).items()}, str(st), metadata={"format": "pt"})
    path = repack(tmp_path / "hf", tmp_path / "install", quiet=True, quant="int4")
    trunk = load_trunk(open_install(path), OpenOptions(kv_cache="float32", native=False, quant_cpu="packed"), "cpu")
    cs = CudaTrunkStep(trunk, host_device, capacity=16)
    assert cs.layers[0]["proj"].fmt == "int4"
    a, b = trunk.new_state(16), trunk.new_state(16)
    ra, rb = trunk.prefill(a, [5, 17, 99]), cs.prefill(b, [5, 17, 99], (), False)
    for _ in range(2):
        torch.testing.assert_close(rb.logits, ra.logits, rtol=1e-4, atol=1e-4)
        tok = int(ra.logits[-1].argmax())
        assert int(rb.logits[-1].argmax()) == tok
        ra, rb = trunk.step(a, [tok], (), None), cs.step(b, [tok], (), None)
    cs.close()

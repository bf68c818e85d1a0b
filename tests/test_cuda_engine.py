"""The whole engine on backend=cuda (docs/DESIGN.md 7): the trunk through the CUDA step of its own
(turbo/backends/cuda_step), the drafters and sampling on the host. On the simulated device the
same engine runs in tests/test_cuda_sim_engine.py.

On a GPU (skipped without one): `turbo.open(path, backend="cuda").generate(prompt,
policy="fixed", block=b, rollback=r)` commits the CPU backend's tokens for b in 1..8 and both
rollbacks, on a random trunk + DFlash2 drafter install, an int4 install (the int4 rows
product), an MTP install and the embedded install `turbo/installs/tiny` when it is shipped; and
speculation on cuda commits exactly what plain decoding on cuda commits (lossless on the GPU).

Everywhere (CI has no GPU):
- the wiring of turbo/backends/cuda.py's kernel wrappers (the torch step's ops on CUDA tensors: no
  longer backend cuda's trunk, kept for the drafters' kernels): the engine with turbo.backends.ops'
  CUDA dispatch forced on CPU tensors, its launches going to test_cuda's transcription of each
  kernel, commits the CPU backend's tokens;
- the device audit: trunk, DFlash2 drafter and MTP head built on the `meta` device run their
  forward and rollback paths; a tensor made on the host and mixed into the math raises there.
"""

from __future__ import annotations

import pytest
import torch

import turbo
from turbo.backends import cuda as cb
from turbo.backends import cuda_kernels as ck
from turbo.backends import ops
from turbo.store.install import BUNDLED_DIR, open_install

torch.set_num_threads(1)

gpu = pytest.mark.skipif(cb.cuda_unavailable_reason() is not None,
                         reason=f"backend cuda cannot run here ({cb.cuda_unavailable_reason()})")
PROMPTS = [list(range(5, 40)), [7, 100, 3, 250, 17, 17, 17, 42]]
NEW = 37  # not a multiple of any block above 1
ROLLBACKS = ("checkpoint", "replay")


def first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at token {i}: {a[i:i + 4]} vs {b[i:i + 4]}"


def same_tokens(cpu, gpu_rt, prompts, blocks=range(1, 9), drafter="auto", new=NEW):
    """cuda plain == cpu plain; cuda speculative (each block, each rollback) == cpu plain."""
    for prompt in prompts:
        want = cpu.generate(prompt, max_new_tokens=new, policy="off", stop_at_eos=False).tokens
        plain = gpu_rt.generate(prompt, max_new_tokens=new, policy="off", stop_at_eos=False).tokens
        assert plain == want, f"cuda plain vs cpu: {first_difference(plain, want)}"
        for block in blocks:
            for rollback in ROLLBACKS:
                out = gpu_rt.generate(prompt, max_new_tokens=new, policy="fixed", block=block, rollback=rollback,
                                      drafter=drafter, stop_at_eos=False)
                assert out.stats.backend == "cuda" and out.stats.block == block
                assert out.tokens == plain, (f"cuda block {block} {rollback} vs cuda plain: "
                                             f"{first_difference(out.tokens, plain)}")


# ---- on a GPU -----------------------------------------------------------------------------------


@gpu
def test_gpu_runtime_steps_the_trunk_on_the_device(spec_install):
    """backend cuda: the trunk's step is the CUDA step of its own on the device (its matrices
    uploaded as stored at open); the host keeps the weights as read, the drafters and sampling."""
    from turbo.backends.cuda_step.step import CudaTrunkStep

    rt = turbo.open(spec_install[1], backend="cuda")
    assert rt.device.type == "cpu" and isinstance(rt.trunk.stepper, CudaTrunkStep)
    assert rt.trunk.stepper.dev._dev is ck.kernels(0) and rt.trunk.kv_dtype == torch.float32
    st = rt.trunk.new_state(64)
    rt.trunk.prefill(st, list(range(5, 30)))
    assert st.scratch["cuda"]["kv"] and st.pos == 25  # K/V on the device (mirrored to st.kv on the host)


@gpu
def test_gpu_spec_install_commits_the_cpu_tokens(spec_install):
    same_tokens(turbo.open(spec_install[1], backend="cpu"), turbo.open(spec_install[1], backend="cuda"), PROMPTS)


@gpu
def test_gpu_int4_install_commits_the_cpu_tokens(tmp_path_factory):
    from turbo.repack import repack
    from turbo.testing import hf_config, make_checkpoint, make_drafter

    tmp = tmp_path_factory.mktemp("cuda_int4")
    make_checkpoint(tmp / "hf", 3)
    cfg = hf_config()
    d = make_drafter(tmp / "drafter", cfg.hidden_size, cfg.vocab_size, [0, cfg.num_hidden_layers - 2], seed=3)
    path = repack(tmp / "hf", tmp / "install", drafter=d, quiet=True, quant="int4")
    rt = turbo.open(path, backend="cuda")
    assert rt.trunk.stepper.layers[0]["proj"].fmt == "int4"  # resident packed: bgemv.cu's int4 rows product
    same_tokens(turbo.open(path, backend="cpu"), rt, PROMPTS[:1], blocks=(1, 3, 8))


@gpu
def test_gpu_mtp_install_commits_the_cpu_tokens(tmp_path_factory):
    from test_mtp import add_mtp, mtp_tensors

    from turbo.repack import repack
    from turbo.testing import make_checkpoint

    tmp = tmp_path_factory.mktemp("cuda_mtp")
    model = make_checkpoint(tmp / "hf", 5)
    add_mtp(tmp / "hf", mtp_tensors(model.config, 5))
    path = repack(tmp / "hf", tmp / "install", quiet=True)
    same_tokens(turbo.open(path, backend="cpu"), turbo.open(path, backend="cuda"), PROMPTS, drafter="mtp")


@gpu
@pytest.mark.skipif(not (BUNDLED_DIR / "tiny" / "config.json").is_file(),
                    reason="the embedded install turbo/installs/tiny is not shipped in this checkout")
def test_gpu_embedded_tiny_commits_the_cpu_tokens():
    cpu, gpu_rt = turbo.open("tiny", backend="cpu"), turbo.open("tiny", backend="cuda")
    prompts = ["def fibonacci(n):\n    ", "The history of the city begins", "Q: 17 * 23 + 5 = ?\nA:"]
    same_tokens(cpu, gpu_rt, [cpu.encode(p) for p in prompts], new=48)


# ---- everywhere: the wiring, through the emulated kernels ---------------------------------------


@pytest.fixture
def emulated_dispatch(monkeypatch):
    """turbo.backends.ops sends CPU tensors to the kernel wrappers; their launches run test_cuda's
    transcription of each kernel (which checks the arguments against the PTX's parameters)."""
    from test_cuda import Emulator

    emu = Emulator()
    monkeypatch.setenv("TURBO_NATIVE", "0")  # the torch step: the one that dispatches to the kernels
    monkeypatch.setattr(ck, "kernels", lambda device=None: emu)
    monkeypatch.setattr(cb, "_need_cuda", lambda t, name: None)
    monkeypatch.setattr(ops, "cuda_kernels", lambda t: cb if ops.CUDA_KERNELS else None)
    return emu


def test_engine_through_the_kernel_wrappers_commits_the_cpu_tokens(spec_install, emulated_dispatch):
    prompt = PROMPTS[1]
    ops.CUDA_KERNELS = False
    try:
        want = turbo.open(spec_install[1], backend="cpu").generate(prompt, max_new_tokens=20, policy="off").tokens
    finally:
        ops.CUDA_KERNELS = True
    rt = turbo.open(spec_install[1], backend="cpu")
    assert rt.generate(prompt, max_new_tokens=20, policy="off").tokens == want
    for block, rollback in ((1, "checkpoint"), (3, "replay"), (8, "checkpoint"), (5, "replay")):
        out = rt.generate(prompt, max_new_tokens=20, policy="fixed", block=block, rollback=rollback)
        assert out.tokens == want, (block, rollback, first_difference(out.tokens, want))
    launched = set(emulated_dispatch.launches)
    assert {"gdn_recurrence_f32", "conv_window_silu_f32", "gated_rms_norm_f32", "grouped_conv_f32",
            "select_candidates_f32"} <= launched


def test_quantized_linear_goes_to_the_gemv_kernel(emulated_dispatch):
    from turbo.store import quant

    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(1))
    packed, scales, biases = quant.quantize(w, quant.FORMATS["int4"])
    qw = quant.QuantizedWeight(packed, scales, biases, 4, 64)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    got = ops.linear(x, qw)
    assert emulated_dispatch.launches == ["affine_gemv_q4_f32"]
    torch.testing.assert_close(got, x @ qw.dequantize().T, rtol=1e-4, atol=1e-4)


# ---- everywhere: every tensor of the forward on the model's device ------------------------------


def test_forward_and_rollback_stay_on_the_device(spec_install, monkeypatch):
    """On `meta`, a host tensor mixed into the math raises ('not on the expected device')."""
    from turbo.load.loader import load_dflash, load_trunk
    from turbo.sequence.options import OpenOptions

    monkeypatch.setattr(ops, "calibrate_rows", lambda w, *a, **k: 0)  # a measurement: meaningless on meta
    meta = torch.device("meta")
    inst = open_install(spec_install[1])
    trunk = load_trunk(inst, OpenOptions(), meta)
    assert all(m.device == meta for m in trunk.matrices()) and trunk.inv_freq.device == meta
    st = trunk.new_state(16)
    out = trunk.prefill(st, list(range(5, 30)), (0, 2))  # grows the 16-slot caches, too
    assert out.logits.device == meta and all(k.shape[1] >= 25 for k, _ in st.kv.values())
    for keep in ("checkpoint", "replay", None):
        step = trunk.step(st, [3, 4, 5], (0, 2), keep)
        assert step.logits.device == meta
        if keep:
            trunk.rollback(st, step, 3, 1, keep)
    d = load_dflash(inst, trunk.embed, trunk.lm_head, device=meta)
    d.begin(out)
    logits, final = d.forward_block(7, d.context, 4)
    assert logits.device == final.device == meta
    d.commit(step, 2, [4, 5])


def test_mtp_head_stays_on_the_device(tmp_path, monkeypatch):
    from test_mtp import add_mtp, mtp_tensors

    from turbo.load.loader import load_mtp, load_trunk
    from turbo.repack import repack
    from turbo.sequence.options import OpenOptions
    from turbo.testing import make_checkpoint

    model = make_checkpoint(tmp_path / "hf", 5)
    add_mtp(tmp_path / "hf", mtp_tensors(model.config, 5))
    inst = open_install(repack(tmp_path / "hf", tmp_path / "install", quiet=True))
    monkeypatch.setattr(ops, "calibrate_rows", lambda w, *a, **k: 0)
    meta = torch.device("meta")
    trunk = load_trunk(inst, OpenOptions(), meta)
    head = load_mtp(inst, trunk)
    assert head.fc.device == meta and head.k.device == meta
    st = trunk.new_state(16)
    out = trunk.prefill(st, list(range(5, 30)))
    head.begin(out, list(range(5, 31)))
    o, logits = head.step_row(head.last_x, head.filled - 1)
    assert o.device == logits.device == meta
    head.commit(out, 1, [9])

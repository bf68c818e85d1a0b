"""The CUDA step's cost plan as tests (issue #55), on the simulated device (turbo/backends/cuda_sim):
launches a layer at decode, bytes read per decode step against the floor (weights as stored + GDN
state + the K/V read), no host sync inside a captured step, and the graph replaying the eager
launch list with the eager step's bits. DEVICE-UNVERIFIED: what a GPU does with the graph is not
shown here; the simulated driver refuses what the real one refuses during a capture (a sync)."""

from __future__ import annotations

import pytest
import torch

from turbo.backends import cuda_sim, native_lib
from turbo.backends.cuda_kernels import CudaError
from turbo.backends.cuda_step import plan
from turbo.backends.cuda_step.step import CudaTrunkStep
from turbo.load.loader import load_trunk
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install

torch.set_num_threads(1)

LAUNCHES_PER_LAYER = 8  # a dense layer at decode: 2 norms, 4 products, the mixer, silu_mul
HEAD_LAUNCHES = 3  # embed, final norm, lm_head
READ_OVER_FLOOR = 1.1


@pytest.fixture(scope="module")
def small(tmp_path_factory, host_device):
    """A 2-layer install (Gated DeltaNet, attention), bf16, small widths: the counts and the graph."""
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    from turbo.testing import make_install

    tmp = tmp_path_factory.mktemp("cuda_plan")
    _, path = make_install(tmp, 3, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                           linear_key_head_dim=16, linear_value_head_dim=16)
    trunk = load_trunk(open_install(path), OpenOptions(dtype="bfloat16", kv_cache="float32"), "cpu")
    return trunk, host_device


@pytest.fixture(scope="module")
def widths_08b(tmp_path_factory, host_device):
    """The 0.8B shape's widths (hidden 1024, MLP 3584, GDN 16 x 128, attention 8 / 2 heads of 256),
    one GDN and one attention layer, its vocab cut to 2048 rows (the lm_head is read as stored at
    any height: the rule is about what the step reads beyond the floor)."""
    from turbo.repack import repack
    from turbo.testing.shapes import SHAPES, write_checkpoint

    tmp = tmp_path_factory.mktemp("cuda_plan_08b")
    shape = {**SHAPES["qwen3.5-0.8b"], "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
             "vocab_size": 2048}
    write_checkpoint(tmp / "hf", shape)
    path = repack(tmp / "hf", tmp / "install", quiet=True)
    trunk = load_trunk(open_install(path), OpenOptions(dtype="bfloat16", kv_cache="float32"), "cpu")
    return trunk, host_device


class _Counting:
    """The host device, counting the step's syncs, captures and graph launches (the rest passes)."""

    def __init__(self, dev, sync_in: str | None = None):
        self.dev, self.sync_in = dev, sync_in
        self.syncs = self.captures = self.graph_launches = 0

    def sync(self, stream=None):
        self.syncs += 1
        self.dev.sync(stream)

    def begin_capture(self, stream):
        self.captures += 1
        self.dev.begin_capture(stream)

    def graph_launch(self, g, stream):
        self.graph_launches += 1
        self.dev.graph_launch(g, stream)

    def launch(self, module, kernel, grid, block, args, shared=0, stream=None):
        if kernel == self.sync_in:  # negative control: a host sync in the middle of the step
            self.dev.sync()
        self.dev.launch(module, kernel, grid, block, args, shared, stream)

    def __getattr__(self, name):
        return getattr(self.dev, name)


def test_decode_launches_per_layer(small):
    """At decode each layer is 8 launches (the 0.8B shape's layers are these two kinds), the step 8 L + 3."""
    trunk, dev = small
    cs = CudaTrunkStep(trunk, dev, capacity=32)
    st = trunk.new_state(32)
    cs.prefill(st, [5, 17, 99], (), False)
    cost = plan.measure(cs, st, [7])
    assert [p.launches for p in cost.layers] == [LAUNCHES_PER_LAYER] * 2
    assert cost.head.launches == HEAD_LAUNCHES and cost.launches == LAUNCHES_PER_LAYER * 2 + HEAD_LAUNCHES
    assert cost.layers[0].kernels[2] == "gdn_step_ind_f32" and cost.layers[1].kernels[2] == "attn_rows_ind_f32"
    cs.close()


def test_decode_bytes_read_within_the_floor_at_the_08b_widths(widths_08b):
    """Bytes the kernels read in a decode step (unique per launch, summed) <= 1.1 x the weights as
    stored + the GDN state and window + the K/V of the positions before it (measured: 1.002)."""
    trunk, dev = widths_08b
    cs = CudaTrunkStep(trunk, dev, capacity=64)
    st = trunk.new_state(64)
    cs.prefill(st, [1, 2, 3, 4], (), False)
    cost = plan.measure(cs, st, [7])
    fl = plan.floor(cs, 4, 1, 1)
    ratio = cost.read / fl.total
    assert fl.kv > 0 and fl.state > 0
    print(f"decode read {cost.read} bytes, floor {fl.total} ({fl}): {ratio:.4f}")
    assert 1.0 <= ratio <= READ_OVER_FLOOR, (cost.read, fl)
    cs.close()


def test_a_capture_of_the_step_succeeds_one_launch_and_one_sync_a_step(small):
    """graphs=True: the step of each shape captured once (global mode: a sync anywhere would fail
    it), then every step is one graph launch and one sync, its kernels run from the graph."""
    trunk, dev = small
    counting = _Counting(dev)
    cs = CudaTrunkStep(trunk, counting, capacity=32, graphs=True)
    st = trunk.new_state(32)
    cs.prefill(st, [5, 17, 99], (), False)  # shape (3 rows, 1 logit row)
    before = (counting.syncs, counting.graph_launches, counting.captures)
    cuda_sim.reset_records()
    for t in (7, 8, 9):
        cs.step(st, [t], (), None)  # shape (1, 1): captured at the first, replayed by all three
    recs = cuda_sim.records()
    assert (counting.syncs, counting.graph_launches, counting.captures) == (before[0] + 3, before[1] + 3,
                                                                            before[2] + 1)
    ks = [r for r in recs if r.kind == "launch"]
    assert len(ks) == 3 * (LAUNCHES_PER_LAYER * 2 + HEAD_LAUNCHES) and all(r.graph is not None for r in ks)
    assert len({r.graph for r in ks}) == 1
    cs.close()


def test_a_sync_inside_a_captured_step_fails(small):
    """Negative control: the same step with a host sync before its silu_mul launch: the simulated
    driver refuses the sync during the capture and the capture ends invalidated (CudaError)."""
    trunk, dev = small
    cs = CudaTrunkStep(trunk, _Counting(dev, sync_in="silu_mul_f32"), capacity=32, graphs=True)
    st = trunk.new_state(32)
    with pytest.raises(CudaError, match="captur"):
        cs.prefill(st, [5, 17, 99], (), False)
    cs.close()


def test_the_graph_replays_the_eager_launch_list_with_its_bits(small):
    """One step object, two sequences: one stepped eagerly, one by graph replays: per step, the
    replay's launches are the eager step's (kernel, grid, block, parameters) and its logits,
    hidden rows and (after a verify of 4 with checkpoints and a rollback) the next step's bits
    equal. The per-sequence values (state, K/V addresses, position) come from the seq block."""
    trunk, dev = small
    cs = CudaTrunkStep(trunk, dev, capacity=32, graphs=True)
    a, b = trunk.new_state(32), trunk.new_state(32)

    def both(tokens, rollback=None):
        outs, sigs = [], []
        for st, graphs in ((a, False), (b, True)):
            cs.graphs = graphs
            cuda_sim.reset_records()
            out = (cs.prefill(st, tokens, (), True) if st.pos == 0 else cs.step(st, tokens, (), rollback))
            ks = [r for r in cuda_sim.records() if r.kind == "launch"]
            assert all((r.graph is not None) == graphs for r in ks)
            outs.append(out)
            sigs.append([r.signature() for r in ks])
        assert sigs[0] == sigs[1] and len(sigs[0]) > 0
        assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].hidden, outs[1].hidden)
        return outs

    both([5, 17, 99])
    for t in (7, 8):
        both([t])
    va, vb = both([40, 41, 42, 43], "checkpoint")
    trunk.rollback(a, va, 4, 2, "checkpoint")
    trunk.rollback(b, vb, 4, 2, "checkpoint")
    both([99])
    assert a.pos == b.pos
    cs.graphs = True
    cs.close()


def test_gpu_check_cuda_step_section_runs(host_device, tmp_path):
    """scripts/gpu_check.py's cuda_step section on the simulated device standing for both sides:
    it runs, compares every output and finds eager == graphed == simulated bit for bit."""
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    from scripts import gpu_check

    res = gpu_check.cuda_step_check(tmp_path, device=host_device, sim=host_device, time_iters=2)
    assert res["eager_vs_graphed"]["bit_equal"] and res["device_vs_simulated"]["bit_equal"], res
    assert (tmp_path / "cuda_step.json").is_file()


def test_graphed_prefill_past_a_launch_with_aux_rows_is_the_eager_ones(small):
    """17 rows (graphs of 16 and 1 rows) with a layer's output kept (its DtoD copy inside the
    graph): logits, hidden and aux rows bit-equal to the eager step's."""
    trunk, dev = small
    cs = CudaTrunkStep(trunk, dev, capacity=32, graphs=True)
    prompt = [(13 * i) % 300 + 3 for i in range(17)]
    outs = []
    for graphs in (False, True):
        cs.graphs = graphs
        outs.append(cs.prefill(trunk.new_state(32), prompt, (0,), True))
    for x, y in ((outs[0].logits, outs[1].logits), (outs[0].hidden, outs[1].hidden), (outs[0].aux, outs[1].aux)):
        assert torch.equal(x, y)
    assert set(cs._graphs) == {(16, 16, (0,)), (1, 1, (0,))}
    cs.close()

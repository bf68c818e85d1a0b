"""The trunk's matrix products in native.c -- bf16 weights, affine int4 / int8 read packed --
against a float reference, and a verify row the decode step it stands for, bit for bit, at any
row count and thread count; speculation on quantized installs stays lossless at every block."""

import pytest
import torch

import turbo
from turbo.backends import native_lib, native_pack, ops, packed
from turbo.load.loader import load_trunk
from turbo.repack import repack
from turbo.sequence.options import OpenOptions
from turbo.store import quant
from turbo.store.install import open_install
from turbo.testing import ScriptedDrafter, assert_lossless, make_install, make_moe_install, make_spec_install

pytestmark = pytest.mark.skipif(native_lib.library() is None,
                                reason=f"native library unavailable: {native_lib.why_not()}")

ROWS = range(1, 13)


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def assert_rows_are_steps(trunk, prompt: list[int], tokens: list[int]) -> None:
    """Every R-row step (R in ROWS) gives the logits, bit for bit, of R one-row steps."""
    for rows in ROWS:
        batched, single = trunk.new_state(64), trunk.new_state(64)
        trunk.prefill(batched, prompt)
        trunk.prefill(single, prompt)
        got = trunk.step(batched, tokens[:rows], rollback="checkpoint").logits
        want = torch.cat([trunk.step(single, [t]).logits for t in tokens[:rows]])
        assert torch.equal(got, want), rows
        assert torch.equal(batched.gdn[0][0], single.gdn[0][0]), rows


@pytest.fixture(scope="module")
def bf16_rt(spec_install):
    return turbo.open(spec_install[1], backend="cpu", dtype="bfloat16")


def test_bf16_compute_keeps_the_exact_products(bf16_rt, spec_install, exact_bf16):
    """bf16 weights widened exactly, fp32 multiply-adds (without AMX, or TURBO_BF16_PRODUCTS=exact)."""
    trunk = bf16_rt.trunk
    assert trunk.step_name == "native"
    mats = (trunk.layers[0].gate_up, trunk.layers[0].down, trunk.lm_head)
    assert all(m.layout in ("panels", "panel_pairs") and m.dtype == torch.bfloat16 for m in mats)
    x = torch.randn(3, trunk.arch.hidden)
    for m in mats[:1] + mats[2:]:  # exactly the fp32 products of the widened weights
        assert torch.equal(native_pack.linear_packed(x, m),
                           native_pack.linear_packed(x, native_pack.pack(m.dense().float())))


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n, k", [(48, 64), (37, 23), (300, 130)])
def test_panel_pairs_are_the_panels_products(threads, n, k, exact_bf16):
    """The bf16 layers' "panel_pairs" layout (two inputs' weights widened from one load) gives
    the "panels" products bit for bit, partial panels and an odd k included, at every row count."""
    w = torch.randn(n, k).to(torch.bfloat16)
    pairs, panels = native_pack.pack_rows(lambda a, b: w[a:b], n, torch.bfloat16, "panel_pairs"), native_pack.pack(w)
    assert pairs.wtype == 6 and torch.equal(pairs.dense(), w)
    assert torch.equal(packed.PackedRows(pairs)[torch.tensor([0, n - 1])], w[[0, n - 1]])
    for rows in ROWS:
        x = torch.randn(rows, k)
        assert torch.equal(native_pack.linear_packed(x, pairs), native_pack.linear_packed(x, panels)), rows


needs_amx = pytest.mark.skipif(native_lib.library() is None or not native_lib.library().bf16_products(-1),
                               reason="no AMX-BF16 here (or TURBO_BF16_PRODUCTS=exact)")


@needs_amx
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n, k", [(48, 64), (100, 96), (1030, 1024), (64, 3584)])
def test_amx_rows_stand_alone(threads, n, k):
    """The AMX path (bf16 panel_pairs, k a multiple of 32): every row of an R-row product equals
    that row alone, bit for bit, at every R -- across its 16-row tiles, the 32-row pairs of them,
    partial panels and the threads' split -- and is the product of the inputs rounded to bf16."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    pairs = native_pack.pack_rows(lambda a, b: w[a:b], n, torch.bfloat16, "panel_pairs")
    x = torch.randn(70, k, generator=g)
    full = native_pack.linear_packed(x, pairs)
    alone = torch.cat([native_pack.linear_packed(x[r:r + 1].clone(), pairs) for r in range(70)])
    assert torch.equal(full, alone)
    for rows in (*ROWS, 15, 16, 17, 31, 32, 33, 48, 49):
        for r0 in (0, 5):
            assert torch.equal(native_pack.linear_packed(x[r0:r0 + rows].clone(), pairs), full[r0:r0 + rows]), rows
    want = x.to(torch.bfloat16).double() @ w.double().T
    assert torch.allclose(full.double(), want, rtol=1e-4, atol=1e-4)


@needs_amx
def test_amx_prefill_rows_are_decode_steps(bf16_rt):
    """A bf16 trunk's prefill chunk (its products through AMX) equals the one-row decode steps it
    stands for, bit for bit: hidden rows and logits."""
    trunk = bf16_rt.trunk
    n, rows = 120, 45
    tokens = [(13 * i) % 300 + 3 for i in range(n)]
    a, b = trunk.new_state(n), trunk.new_state(n)
    trunk.prefill(a, tokens[:n - rows]), trunk.prefill(b, tokens[:n - rows])
    chunk = trunk.step(a, tokens[n - rows:], (), None)
    steps = [trunk.step(b, [t], (), None) for t in tokens[n - rows:]]
    assert torch.equal(chunk.hidden, torch.cat([s.hidden for s in steps]))
    assert torch.equal(chunk.logits, torch.cat([s.logits for s in steps]))
    whole = trunk.new_state(n)
    assert torch.equal(trunk.prefill(whole, tokens).hidden[n - rows:], chunk.hidden)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_bf16_verify_rows_are_decode_steps(bf16_rt, threads):
    g = torch.Generator().manual_seed(threads)
    vocab = bf16_rt.trunk.arch.vocab
    prompt, tokens = torch.randint(0, vocab, (9,), generator=g), torch.randint(0, vocab, (12,), generator=g)
    assert_rows_are_steps(bf16_rt.trunk, prompt.tolist(), tokens.tolist())


# ---- affine int4 / int8 read packed ---------------------------------------------------------

QBITS = {"int4": 4, "int8": 8}
# every projection's input width a multiple of 64: all of them quantize, every layer one format
WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=32)


def vnni() -> None:
    if "int8" not in native_lib.dot_layouts():
        pytest.skip("this CPU has no AVX512-VNNI")


def quantized(n: int, k: int, fmt: str, seed: int) -> quant.QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
    return quant.QuantizedWeight(*quant.quantize(w, quant.FORMATS[fmt]), QBITS[fmt], quant.GROUP)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n,k", [(37, 64), (200, 320), (1000, 1024)])
@pytest.mark.parametrize("fmt", list(QBITS))
def test_quantized_products_hold_the_matrix_and_are_row_stable(fmt, n, k, threads):
    vnni()
    qw = quantized(n, k, fmt, n + k)
    p = native_pack.pack_as(qw, torch.float32, "panels")
    w = qw.dequantize()
    assert p.layout == {"int4": "q4", "int8": "q8"}[fmt] and torch.equal(p.dense(), w)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(1)) * 3
    x[0] = 0.0  # a row of zeros: all groups' scales 1, every output 0
    y = native_pack.linear_packed(x, p)
    # the one rounding: each input to the nearest of 255 levels of its group's max |x|, so each
    # output is within half a level times the group's sum |w| (plus fp32 slack) of w . x
    groups = x.abs().reshape(12, -1, quant.GROUP).amax(-1) / 127  # [rows, G]
    w_abs = w.abs().reshape(n, -1, quant.GROUP).sum(-1)  # [n, G]
    bound = 0.5 * groups @ w_abs.T + 1e-5 * (x.abs() @ w.abs().T) + 1e-6
    assert ((y - x @ w.T).abs() <= bound).all()
    assert torch.equal(y[0], torch.zeros(n))
    for rows in ROWS:  # a row's outputs do not depend on the rows computed with it
        assert torch.equal(native_pack.linear_packed(x[:rows], p), y[:rows]), rows
        assert torch.equal(native_pack.linear_packed(x[rows - 1:rows], p), y[rows - 1:rows]), rows


@pytest.fixture(scope="module", params=[("int4", False), ("int8", True)], ids=["int4", "int8-tied"])
def quant_rt(request, tmp_path_factory):
    vnni()
    fmt, tied = request.param
    tmp = tmp_path_factory.mktemp(fmt)
    make_spec_install(tmp, 4, tie_word_embeddings=tied, **WIDE)  # (its HF checkpoint and drafter, quantized)
    out = repack(tmp / "hf4", tmp / "q", drafter=tmp / "drafter4", quiet=True, quant=fmt)
    rt = turbo.open(str(out), backend="cpu")
    return fmt, tied, rt


def test_quantized_installs_run_natively_read_packed(quant_rt):
    fmt, tied, rt = quant_rt
    trunk, layout = rt.trunk, {"int4": "q4", "int8": "q8"}[fmt]
    assert trunk.step_name == "native"
    assert {trunk.layers[i].gate_up.layout for i in range(len(trunk.layers))} == {layout}
    assert trunk.layers[0].mixer.in_proj.layout == layout
    assert trunk.lm_head.layout == layout  # a tied one: a quantized copy; the table stays exact
    if tied:
        table = rt.install.index.load("trunk.embed_tokens.weight", torch.float32)
        assert torch.equal(trunk.embed.float(), table)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_quantized_verify_rows_are_decode_steps(quant_rt, threads):
    trunk = quant_rt[2].trunk
    g = torch.Generator().manual_seed(threads + 10)
    prompt, tokens = torch.randint(0, trunk.arch.vocab, (9,), generator=g), torch.randint(0, trunk.arch.vocab, (12,))
    assert_rows_are_steps(trunk, prompt.tolist(), tokens.tolist())


def test_quantized_speculation_is_lossless_at_every_block(quant_rt):
    rt = quant_rt[2]
    prompt = list(range(7, 40))
    plain = rt.generate(prompt, max_new_tokens=24, policy="off", stop_at_eos=False).tokens
    for block in range(1, 9):
        for rollback in ("checkpoint", "replay"):
            assert_lossless(rt, prompt, plain, block, max_new_tokens=24, stop_at_eos=False, rollback=rollback)


def test_int8_format_bounds_and_repack():
    f = quant.FORMATS["int8"]
    assert (f.code, f.bits, f.group, f.scale_dtype) == (5, 8, 64, torch.bfloat16)
    w = torch.randn(48, 512, generator=torch.Generator().manual_seed(0)) * 0.05
    back = quant.dequantize(*quant.quantize(w, f), f.bits, f.group)
    step = (w.reshape(48, -1, 64).amax(-1) - w.reshape(48, -1, 64).amin(-1)) / 255
    # half a level, plus the bf16 rounding of scale and bias (2^-8 relative, 255 levels)
    bound = (0.5 + 256 * 2.0 ** -8) * step + w.abs().reshape(48, -1, 64).amax(-1) * 2.0 ** -8
    assert ((back - w).abs().reshape(48, -1, 64) <= bound[..., None] + 1e-6).all()


def test_a_layer_of_mixed_formats_runs_in_fp32(tmp_path):
    """Every product of a layer shares one wtype: a layer whose down_proj the group does not
    divide (96 inputs: kept bf16) runs all its matrices in fp32, the quantized ones dequantized."""
    vnni()
    _, path = make_install(tmp_path, 2, intermediate_size=96)
    out = repack(path, tmp_path / "q", quiet=True, quant="int4")
    trunk = load_trunk(open_install(out), OpenOptions(), "cpu")
    assert trunk.step_name == "native" and trunk.layers[0].gate_up.layout == "panels"
    assert trunk.layers[0].gate_up.dtype == torch.float32
    ref = load_trunk(open_install(out), OpenOptions(quant_cpu="dequant"), "cpu")
    assert torch.equal(ops.dense(trunk.layers[0].gate_up), ops.dense(ref.layers[0].gate_up).float())


def moe_int4_install(tmp, **over):
    """An MoE install (a shared expert, every layer routed) repacked with --quant int4, at widths
    the group of 64 divides."""
    _, path = make_moe_install(tmp, 6, hidden_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                               **over)
    return repack(path, tmp / "q", quiet=True, quant="int4")


@pytest.fixture(scope="module")
def moe_int4(tmp_path_factory):
    return moe_int4_install(tmp_path_factory.mktemp("moe_int4"))  # 8 experts, top-2


def test_moe_experts_are_read_packed(tmp_path):
    """The experts and the shared expert stay int4 (a fraction of their floats' bytes); the router
    and the shared expert's gate are floats. Against the same install dequantized at load, the
    difference is the inputs' rounding to 8 bits per group of 64 (~0.7% of a product's largest
    output, over ~40 products: every expert picked, so no row's routing can flip)."""
    vnni()
    install = moe_int4_install(tmp_path, num_experts=4, num_experts_per_tok=4)
    trunk = load_trunk(open_install(install), OpenOptions(), "cpu")
    ref = load_trunk(open_install(install), OpenOptions(quant_cpu="dequant"), "cpu")
    assert trunk.step_name == ref.step_name == "native"
    blocks = [layer.moe for layer in trunk.layers if layer.moe is not None]
    experts = [w for m in blocks for w in [*m.gate_up, *m.down, m.shared_gate_up, m.shared_down]]
    assert blocks and {w.layout for w in experts} == {"q4"}
    assert {m.router.layout for m in blocks} | {m.shared_gate.layout for m in blocks} <= {"panels", "panel_pairs"}
    dense = [w for layer in ref.layers for w in [*layer.moe.gate_up, *layer.moe.down]]
    assert sum(w.data.nbytes for w in experts) < 0.2 * sum(w.data.nbytes for w in dense)
    prompt = list(range(3, 40))
    got = trunk.prefill(trunk.new_state(64), prompt, want_logits=True).logits
    want = ref.prefill(ref.new_state(64), prompt, want_logits=True).logits
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_moe_int4_verify_rows_are_decode_steps(moe_int4, threads):
    vnni()
    trunk = load_trunk(open_install(moe_int4), OpenOptions(), "cpu")
    g = torch.Generator().manual_seed(threads + 20)
    prompt, tokens = torch.randint(0, trunk.arch.vocab, (9,), generator=g), torch.randint(0, trunk.arch.vocab, (12,))
    assert_rows_are_steps(trunk, prompt.tolist(), tokens.tolist())


def test_moe_int4_speculation_is_lossless_at_every_block(moe_int4):
    """Rounds landing 0..block proposals (a scripted drafter) through the routed int4 verify."""
    vnni()
    rt = turbo.open(str(moe_int4), backend="cpu")
    prompt = list(range(7, 40))
    plain = rt.generate(prompt, max_new_tokens=24, policy="off", stop_at_eos=False).tokens
    for block in range(1, 9):
        for rollback in ("checkpoint", "replay"):
            scripted = ScriptedDrafter(prompt + plain, [r % (block + 1) for r in range(64)],
                                       rt.trunk.arch.vocab)
            res = rt.generate(prompt, max_new_tokens=24, policy="fixed", block=block, rollback=rollback,
                              drafter=scripted, stop_at_eos=False)
            assert res.tokens == plain, (block, rollback)
            assert res.stats.accepted > 0 and res.stats.rollbacks > 0, (block, rollback)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_panels_packed_a_slice_at_a_time_are_the_whole_matrix(fmt):
    """quantized_panels unpacks `rows` outputs at a time (a vocab-sized head at once held GBs):
    the bytes are those of one pass, a last partial panel included."""
    w = quantized(100, 128, fmt, 3)
    whole, sliced = native_pack.quantized_panels(w, rows=1 << 20), native_pack.quantized_panels(w, rows=32)
    assert torch.equal(whole.data, sliced.data) and whole.data.shape[0] == 7

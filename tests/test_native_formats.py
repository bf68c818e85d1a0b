"""The native step reading the converted formats as stored (turbo/backends/native_exact.py): exact
int4gG / int8g32 (fp32 scales and biases) and FP8 codes with block scales. Their products hold the
torch step's dequantized weights exactly (the sums within fp32 rounding of theirs; FP8: the bf16
install's products bit for bit), a verify row is the decode step it stands for, bit for bit, and
speculation on the converted installs is lossless."""

from __future__ import annotations

import pytest
import torch
from test_repack_formats import _source, assert_lossless_speculation
from test_trunk_products import ROWS, assert_rows_are_steps, threads  # noqa: F401  (the fixture)

import turbo
from turbo.backends import native_exact, native_lib, native_pack
from turbo.load.loader import load_trunk
from turbo.repack import fp8 as repack_fp8
from turbo.repack import repack
from turbo.sequence.options import OpenOptions
from turbo.store import quant
from turbo.store.install import open_install


def needs_exact() -> None:
    if native_lib.library() is None or "exact" not in native_lib.dot_layouts():
        pytest.skip("no native library with AVX512-BW products here")


@pytest.fixture(autouse=True)
def _exact():
    needs_exact()


def needs_fp8() -> None:
    if "fp8" not in native_lib.dot_layouts():
        pytest.skip("this CPU has no AVX512-VBMI (the FP8 products' byte tables)")


def fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far two fp32 sums of the k products x_i w_i may lie apart (any order, fused or not):
    k units of 2^-24 of sum |x_i w_i| each (the standard bound), plus the subnormal slack."""
    return x.shape[1] * 2.0 ** -23 * (x.abs().double() @ w.abs().double().T) + 1e-30


def fp8_weight(n: int, k: int, seed: int) -> quant.QuantizedWeight:
    """Random e4m3 codes (no NaN) and a block scale per 128 x 128, as quant.FP8 keeps them."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    scale_inv = torch.rand(-(-n // 128), k // 128, generator=g) * 0.01
    return quant.QuantizedWeight(*repack_fp8.fp8_install(codes.view(torch.float8_e4m3fn), scale_inv, (128, 128)),
                                 8, 128, float8=True)


FORMATS = ["int4g32", "int4g64", "int4g128", "int8g32"]


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n,k", [(37, 128), (300, 512)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_exact_products_hold_the_dequantized_matrix(fmt, n, k, threads):
    f = quant.GGUF_FORMATS.get(fmt) or quant.EXACT_INT4[int(fmt[5:])]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) / k ** 0.5
    qw = quant.QuantizedWeight(*quant.quantize(w, f), f.bits, f.group)
    p = native_pack.pack_as(qw, torch.float32, "panels")
    dense = qw.dequantize()  # the torch step's weights: q * scale + bias in fp32
    assert p.layout == "exact" and torch.equal(p.dense(), dense)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(1))
    y = native_pack.linear_packed(x, p)
    assert ((y.double() - x.double() @ dense.double().T).abs() <= fp32_bound(x, dense)).all()
    for rows in ROWS:
        assert torch.equal(native_pack.linear_packed(x[:rows], p), y[:rows]), rows
        assert torch.equal(native_pack.linear_packed(x[rows - 1:rows], p), y[rows - 1:rows]), rows


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n,k", [(256, 128), (200, 384)])
def test_fp8_products_are_the_bf16_products(n, k, threads, exact_bf16):
    """Each code widened through its block's table bf16(e4m3 * scale): transformers' bf16 weights,
    and the bf16 panels' exact products of them (their fp32 walk, not AMX's) bit for bit, at every
    row count."""
    needs_fp8()
    qw = fp8_weight(n, k, n + k)
    bf16 = qw.dequantize(torch.bfloat16)
    p, ref = native_pack.pack_as(qw, torch.float32, "panels"), native_pack.pack_rows(
        lambda a, b: bf16[a:b], n, torch.bfloat16, "panel_pairs")
    assert p.layout == "fp8" and torch.equal(p.dense(), bf16.float())
    assert p.data.nbytes < 0.52 * ref.data.nbytes  # (a table of 256 bytes per 128 x 128 block)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(2))
    for rows in ROWS:
        assert torch.equal(native_pack.linear_packed(x[:rows], p), native_pack.linear_packed(x[:rows], ref)), rows


def test_segments_are_their_parts_side_by_side():
    parts = [native_pack.pack_as(quant.QuantizedWeight(*quant.quantize(torch.randn(40, 128), quant.EXACT_INT4[32]),
                                                       4, 32), torch.float32, "panels"),
             native_pack.pack(torch.randn(21, 128).to(torch.bfloat16)), native_pack.pack(torch.randn(3, 128))]
    seg = native_exact.segments(parts)
    assert seg.wtype == 7 and torch.equal(seg.dense(), torch.cat([p.dense().float() for p in parts]))
    x = torch.randn(5, 128)
    assert torch.equal(native_pack.linear_packed(x, seg), torch.cat([native_pack.linear_packed(x, p) for p in parts], 1))


# ---- converted installs -------------------------------------------------------------------

SOURCES = {"awq-g128": ("awq", dict(group=128)), "gptq-g32": ("gptq", dict(group=32, sym=True)), "fp8": ("fp8", {})}


@pytest.fixture(scope="module", params=list(SOURCES))
def converted(request, tmp_path_factory):
    kind, kw = SOURCES[request.param]
    if kind == "fp8":
        needs_fp8()
    tmp = tmp_path_factory.mktemp(request.param)
    _, src, _ = _source(tmp, kind, **kw)
    return request.param, src, repack(src, tmp / "out", quiet=True)


def assert_native_agrees(install, prompt: list[int], layout: str):
    """The native step reads `install`'s matrices as stored (`layout`) and agrees with the torch
    step on it: logits within 1e-4 of the largest (the same weights, each sum within fp32 rounding
    of torch's, compounded through the layers' recurrences; measured ~3e-5), the same 64 greedy
    tokens. Returns the native trunk."""
    nat = load_trunk(open_install(install), OpenOptions(), "cpu")
    ref = load_trunk(open_install(install), OpenOptions(native=False), "cpu")
    assert nat.step_name == "native" and ref.step_name == "torch"
    assert {p.layout for layer in nat.layers for m in (layer.gate_up, layer.down) for p in m.parts} == {layout}
    got = nat.prefill(nat.new_state(64), prompt, want_logits=True).logits
    want = ref.prefill(ref.new_state(64), prompt, want_logits=True).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    a, b = (turbo.open(install, backend="cpu", native=on) for on in (True, False))
    assert a.generate(prompt, max_new_tokens=64, policy="off", stop_at_eos=False).tokens == \
        b.generate(prompt, max_new_tokens=64, policy="off", stop_at_eos=False).tokens
    return nat


def test_the_native_step_reads_them_as_stored_and_agrees_with_the_torch_step(converted):
    name, _, out = converted
    assert_native_agrees(out, list(range(3, 30)), "fp8" if name == "fp8" else "exact")


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_verify_rows_are_decode_steps(converted, threads):
    trunk = load_trunk(open_install(converted[2]), OpenOptions(), "cpu")
    g = torch.Generator().manual_seed(5)
    prompt, tokens = torch.randint(0, trunk.arch.vocab, (9,), generator=g), torch.randint(0, trunk.arch.vocab, (12,))
    assert_rows_are_steps(trunk, prompt.tolist(), tokens.tolist())


def test_speculation_is_lossless(converted):
    assert_lossless_speculation(turbo.open(converted[2], backend="cpu"), mtp=converted[0] == "fp8")


def test_fp8_install_decodes_as_the_bf16_install_bit_for_bit(converted, tmp_path, monkeypatch):
    """The FP8 install (codes + scales, 8 bits a weight) and the bf16 install of the same source
    (transformers' dequantization): the same logits, bit for bit, and the same 64 greedy tokens."""
    name, src, out = converted
    if name != "fp8":
        pytest.skip("FP8 only")
    monkeypatch.setattr(repack_fp8, "keeps_codes", lambda *_: False)
    bf16 = repack(src, tmp_path / "bf16", quiet=True)
    assert open_install(bf16).index.need("trunk.layers.0.mlp.gate_proj.weight").st_dtype == "BF16"
    a, b = turbo.open(out, backend="cpu"), turbo.open(bf16, backend="cpu")
    prompt = list(range(3, 30))
    la = a.trunk.prefill(a.trunk.new_state(64), prompt, want_logits=True).logits
    lb = b.trunk.prefill(b.trunk.new_state(64), prompt, want_logits=True).logits
    assert torch.equal(la, lb)
    assert a.generate(prompt, max_new_tokens=64, policy="off", stop_at_eos=False).tokens == \
        b.generate(prompt, max_new_tokens=64, policy="off", stop_at_eos=False).tokens


def test_the_plan_reads_them_as_stored_only_where_the_host_has_the_products(converted):
    """Without the products (a host's layouts), the exact formats are dequantized into fp32 panels
    (the same weights); off the CPU, FP8 is dequantized at load (no kernel reads the codes)."""
    from test_load_plan import headers_only

    from turbo.load.load_plan import EXACT, PANELS, SEGMENTS, TENSOR, Host, layer_matrices, plan_trunk
    name, _, out = converted
    inst = open_install(out)
    layout = "fp8" if name == "fp8" else "exact"

    def forms(host, device="cpu"):
        p = plan_trunk(headers_only(inst), inst.arch, OpenOptions(), torch.device(device), host)
        return [m for layer in p.layers for m in layer_matrices(layer)]

    assert {m.form for m in forms(Host(None, ("int8", layout)))} == {SEGMENTS}
    assert EXACT in {part.form for m in forms(Host(None, ("int8", layout))) for part in m.parts}
    assert {(m.form, m.dtype) for m in forms(Host(None, ("int8",)))} == {(PANELS, torch.float32)}
    cuda = forms(Host(), "cuda")
    assert {m.form for m in cuda} == {TENSOR}
    if name == "fp8":
        assert not any(s.keep for m in cuda for s in m.sources)

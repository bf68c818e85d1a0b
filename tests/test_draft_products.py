"""The drafters' own matrix products (native.c wtype 2 and 3, `draft_products`): the packed
layouts, their arithmetic, the choice and refusals, and that speculation stays lossless."""

import pytest
import torch

import turbo
from turbo.backends import native_lib, native_pack
from turbo.errors import TurboError

pytestmark = pytest.mark.skipif(native_lib.library() is None,
                                reason=f"native library unavailable: {native_lib.why_not()}")

LAYOUTS = ["panels", "pairs", "int8"]
SHAPES = [(48, 64), (37, 13), (100, 258)]  # n not a multiple of 16, k not one of 2 or 4


def available(layout: str) -> None:
    if layout != "panels" and layout not in native_lib.dot_layouts():
        pytest.skip(f"this CPU has no {layout} dot products")


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_hold_the_matrix_and_multiply_by_it(layout, n, k):
    available(layout)
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    x = torch.randn(9, k, generator=g)
    p = native_pack.pack(w, layout)
    dense = p.dense().float()
    if layout == "int8":  # one scale per output: each value within half a step of it
        step = w.float().abs().amax(dim=1, keepdim=True) / 127
        assert ((dense - w.float()).abs() <= step / 2 + 1e-7).all()
    else:
        assert torch.equal(dense, w.float())
    y, ref = native_pack.linear_packed(x, p), x @ w.float().T
    err = ((y - ref).norm() / ref.norm()).item()
    assert err < {"panels": 1e-6, "pairs": 1e-2, "int8": 3e-2}[layout], err
    # row-stable: a row's outputs do not depend on the rows computed with it
    for r in range(9):
        assert torch.equal(native_pack.linear_packed(x[r:r + 1], p), y[r:r + 1])


def test_int8_rows_of_zeros_and_of_one_value():
    w = torch.randn(32, 40).bfloat16()
    w[3] = 0
    p = native_pack.pack(w, "int8")
    x = torch.zeros(2, 40)
    x[1] = 2.5
    if "int8" not in native_lib.dot_layouts():
        pytest.skip("this CPU has no int8 dot products")
    y = native_pack.linear_packed(x, p)
    assert torch.equal(y[0], torch.zeros(32)) and torch.equal(y[1, 3], torch.tensor(0.0))
    assert torch.allclose(y[1], 2.5 * p.dense().float().sum(dim=1), rtol=1e-5, atol=1e-5)


def test_auto_takes_the_fastest_the_cpu_has(monkeypatch):
    for have, want in (((), "panels"), (("pairs",), "pairs"), (("pairs", "int8"), "int8"), (("int8",), "int8")):
        monkeypatch.setattr(native_lib, "dot_layouts", lambda have=have: have)
        assert native_lib.draft_layout("auto") == want
        assert native_lib.draft_layout("fp32") == "panels"


def test_products_the_cpu_lacks_or_unknown_names_are_refused(monkeypatch):
    monkeypatch.setattr(native_lib, "dot_layouts", lambda: ("pairs",))
    with pytest.raises(TurboError, match="int8: this CPU has no AVX512-VNNI"):
        native_lib.draft_layout("int8")
    with pytest.raises(TurboError, match="'int4' is not one of auto, fp32, bf16, int8"):
        turbo.open("tiny", backend="cpu", draft_products="int4")


@pytest.fixture(scope="module")
def plain_runs(spec_install):
    rt = turbo.open(spec_install[1], backend="cpu")
    prompts = [list(range(5, 40)), [7, 100, 3, 250, 17, 17, 17, 42]]
    return prompts, [rt.generate(p, max_new_tokens=33, policy="off").tokens for p in prompts]


@pytest.mark.parametrize("products", ["fp32", "bf16", "int8"])
def test_every_products_choice_is_lossless(spec_install, plain_runs, products):
    available(native_lib.DRAFT_PRODUCTS[products])
    rt = turbo.open(spec_install[1], backend="cpu", draft_products=products)
    assert rt.drafter("dflash", None).fc.layout == native_lib.DRAFT_PRODUCTS[products]
    prompts, plain = plain_runs
    for rollback in ("checkpoint", "replay"):
        for block in (3, 8):
            for prompt, ref in zip(prompts, plain):
                out = rt.generate(prompt, max_new_tokens=33, policy="fixed", block=block, rollback=rollback)
                assert out.tokens == ref


def test_named_products_without_the_native_pass_are_refused(spec_install, monkeypatch):
    monkeypatch.setenv("TURBO_NATIVE", "0")
    rt = turbo.open(spec_install[1], backend="cpu", draft_products="int8")
    with pytest.raises(TurboError, match=r"draft_products int8: the drafter's native CPU pass is not in use "
                                         r"\(TURBO_NATIVE=0\)"):
        rt.generate([5, 6, 7], max_new_tokens=4, policy="fixed", block=2)
    fp32 = turbo.open(spec_install[1], backend="cpu", draft_products="fp32")  # the torch pass is fp32: fine
    assert fp32.generate([5, 6, 7], max_new_tokens=4, policy="fixed", block=2).tokens


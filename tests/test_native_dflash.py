"""The DFlash2 drafter's native pass (native_dflash.c) against its torch reference."""

import json
import shutil

import pytest
import torch

import turbo
from turbo.backends import native_lib, ops
from turbo.backends.dflash_math import select_candidates
from turbo.drafters.dflash import DflashDrafter
from turbo.load.loader import load_dflash, load_trunk
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install

pytestmark = pytest.mark.skipif(native_lib.library() is None,
                                reason=f"native library unavailable: {native_lib.why_not()}")

TOLERANCE = 1e-4  # max abs difference, relative to the reference's largest magnitude
# the same for the whole pass with the drafter-only products, on the trained tiny drafter
# (measured: bf16 8e-3, int8 5e-2; a random drafter's layers amplify the rounding far more)
LOW_PRECISION = {"bf16": 3e-2, "int8": 1.5e-1}


def pair(inst, trunk, embed=None, products="fp32", **kw) -> tuple[DflashDrafter, DflashDrafter]:
    """The same drafter twice: through native_dflash.c (with `products`), and through the torch code."""
    embed = trunk.embed if embed is None else embed
    lm_head = ops.dense(trunk.lm_head)  # as the engine passes it
    fast = load_dflash(inst, embed, lm_head, opts=OpenOptions(draft_products=products), **kw)
    ref = load_dflash(inst, embed, lm_head, opts=OpenOptions(native=False), **kw)
    assert fast.step_name == "native" and ref.step_name == "torch"
    return fast, ref


def assert_close(a: torch.Tensor, b: torch.Tensor, tolerance: float = TOLERANCE) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
    assert (a - b).abs().max().item() < tolerance * b.abs().max().item()


def need(products: str) -> None:
    if native_lib.DRAFT_PRODUCTS[products] not in native_lib.dot_layouts():
        pytest.skip(f"this CPU has no {products} dot products")


@pytest.fixture(scope="module")
def random_model(spec_install):
    inst = open_install(spec_install[1])
    return inst, load_trunk(inst, OpenOptions(), "cpu")


@pytest.fixture(scope="module")
def tiny():
    rt = turbo.open("tiny", backend="cpu")
    return rt.install, rt.trunk


def check_blocks(inst, trunk, ids: list[int], embed=None, tolerance: float = TOLERANCE, **kw) -> None:
    """Context from the trunk's prefill of ids[:-1] (in two batches, so rows also arrive
    after the first), then every block 1..8 from the last id."""
    fast, ref = pair(inst, trunk, embed, **kw)
    out = trunk.prefill(trunk.new_state(len(ids) + 8), ids[:-1], fast.aux_layers)
    for d in (fast, ref):
        d.begin(None)
        d.add_context(out.aux[:len(ids) // 2])
        d.add_context(out.aux[len(ids) // 2:])
    for rk, rv, qk, qv in zip(fast.ring_k, fast.ring_v, ref.ring_k, ref.ring_v):
        assert_close(rk, qk, tolerance)
        assert_close(rv, qv, tolerance)
    pos = len(ids) - 1
    for block in range(1, 9):
        logits, final = fast.forward_block(ids[-1], pos, block)
        ref_logits, ref_final = ref.forward_block(ids[-1], pos, block)
        assert_close(logits, ref_logits, tolerance)
        assert_close(final, ref_final, tolerance)
        again = fast.forward_block(ids[-1], pos, block)  # deterministic
        assert torch.equal(logits, again[0]) and torch.equal(final, again[1])


def ids_of(n: int, vocab: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("positions, window", [(40, None), (300, 6)])  # short context; a wrapped ring
def test_random_drafter_matches_torch(random_model, positions, window):
    inst, trunk = random_model
    check_blocks(inst, trunk, ids_of(positions, 320, positions), window=window)


def test_causal_drafter_matches_torch(spec_install, tmp_path):
    """No shipped drafter is causal: the same random one with is_causal set checks the mask."""
    path = shutil.copytree(spec_install[1], tmp_path / "causal")
    config = json.loads((path / "dflash" / "config.json").read_text())
    (path / "dflash" / "config.json").write_text(json.dumps(config | {"is_causal": True}))
    inst = open_install(path)
    check_blocks(inst, load_trunk(inst, OpenOptions(), "cpu"), ids_of(40, 320, 5))


@pytest.mark.parametrize("positions, window", [(40, None), (300, None), (300, 16)])  # short; window-limited; wrapped
def test_tiny_drafter_matches_torch(tiny, positions, window):
    inst, trunk = tiny
    check_blocks(inst, trunk, ids_of(positions, inst.arch.vocab, positions), window=window)


def test_bf16_embedding_rows_and_unit_scale(tiny):
    inst, trunk = tiny
    check_blocks(inst, trunk, ids_of(50, inst.arch.vocab, 7), embed=ops.dense(trunk.lm_head).bfloat16(), scale=1.0)


def test_tiny_proposals_equal_torch(tiny):
    inst, trunk = tiny
    rt = turbo.open("tiny", backend="cpu")
    fast, ref = pair(inst, trunk)
    for prompt in ("def fibonacci(n):\n    ", "The quick brown fox", "import numpy as np\n"):
        ids = rt.encode(prompt)
        out = trunk.prefill(trunk.new_state(len(ids) + 8), ids[:-1], fast.aux_layers)
        for d in (fast, ref):
            d.begin(out)
        assert fast.propose(ids[-1], len(ids) - 1, 8) == ref.propose(ids[-1], len(ids) - 1, 8)


@pytest.mark.parametrize("products", sorted(LOW_PRECISION))
def test_drafter_only_products_stay_near_the_torch_pass(tiny, products):
    need(products)
    inst, trunk = tiny
    check_blocks(inst, trunk, ids_of(60, inst.arch.vocab, 3), tolerance=LOW_PRECISION[products], products=products)


@pytest.mark.parametrize("products", sorted(LOW_PRECISION))
def test_drafter_only_products_mostly_propose_what_fp32_proposes(tiny, products):
    """They move acceptance, never the output: on the tiny model they should move it little."""
    need(products)
    inst, trunk = tiny
    rt = turbo.open("tiny", backend="cpu")
    fast, exact = pair(inst, trunk, products=products)[0], pair(inst, trunk)[0]
    same = total = 0
    for prompt in ("def fibonacci(n):\n    ", "The quick brown fox", "import numpy as np\n", "12 + 35 = "):
        ids = rt.encode(prompt)
        out = trunk.prefill(trunk.new_state(len(ids) + 8), ids[:-1], fast.aux_layers)
        for d in (fast, exact):
            d.begin(out)
        a, b = fast.propose(ids[-1], len(ids) - 1, 8), exact.propose(ids[-1], len(ids) - 1, 8)
        same, total = same + sum(x == y for x, y in zip(a, b)), total + 8
    assert same >= 0.75 * total


def test_native_selector_picks_what_the_torch_selector_picks():
    import ctypes

    g = torch.Generator().manual_seed(0)
    B, V, H, rank, k = 8, 300, 32, 8, 16
    for trial in range(60):
        logits, final = torch.randn(B, V, generator=g), torch.randn(B, H, generator=g)
        hp, pc, sc = torch.randn(rank, H, generator=g), torch.randn(V, rank, generator=g), torch.randn(V, rank, generator=g)
        if trial % 2:  # equal scores: the codebooks see nothing, and two top logits tie -> the lower id
            sc.zero_()
            logits[:, 7] = logits[:, 201] = logits.max() + 1
        anchor = int(torch.randint(0, V, (1,), generator=g))
        out = (ctypes.c_int * B)()
        native_lib.library().dflash_select(logits.data_ptr(), final.data_ptr(), B, V, H, hp.data_ptr(), rank,
                                           pc.data_ptr(), sc.data_ptr(), k, anchor, out)
        assert list(out) == select_candidates(logits, final, anchor, hp, pc, sc, k)
        if trial % 2:
            assert list(out) == [7] * B


def test_other_activation_dtypes_keep_the_torch_pass(tiny):
    inst, trunk = tiny
    assert load_dflash(inst, trunk.embed, ops.dense(trunk.lm_head), dtype=torch.bfloat16).step_name == "torch"


def test_out_of_range_inputs_are_refused_before_c_reads_them(random_model):
    inst, trunk = random_model
    fast, _ = pair(inst, trunk)
    with pytest.raises(ValueError, match="aux rows"):
        fast.add_context(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="anchor 320"):
        fast.forward_block(320, 0, 2)


def test_a_vector_with_an_extra_empty_dim_is_refused_before_c_reads_it(spec_install, tmp_path):
    """[64, 0] has the four-wide record of a [64] vector; the full shape tells them apart."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from turbo.errors import TurboError

    dst = shutil.copytree(spec_install[1], tmp_path / "inst")
    path = dst / "dflash" / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["dflash.norm.weight"] = torch.zeros(64, 0)
    save_file(tensors, str(path))
    inst = open_install(dst)
    trunk = load_trunk(inst, OpenOptions(), "cpu")
    with pytest.raises(TurboError, match=r"dflash.norm.weight has shape \[64, 0\], expected a \[64\] vector"):
        load_dflash(inst, trunk.embed, ops.dense(trunk.lm_head))


def test_the_ctypes_mirrors_match_the_compiled_structs(monkeypatch):
    import ctypes

    assert native_lib._struct_mismatch(native_lib.library()) is None

    class Shorter(ctypes.Structure):
        _fields_ = [("hidden", ctypes.c_int)]

    monkeypatch.setattr(native_lib, "STRUCTS", (native_lib.Layer, Shorter, native_lib.DfLayer))
    assert "Shorter is" in native_lib._struct_mismatch(native_lib.library())  # names the struct (Dflash's slot)

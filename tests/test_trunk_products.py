"""The trunk's matrix products in native.c (bf16 pairs under bf16 compute): a verify row is
the decode step it stands for, bit for bit, at any row count and thread count."""

import pytest
import torch
from helpers import make_install

import turbo
from turbo import ops
from turbo.backends import native
from turbo.install import open_install
from turbo.loader import load_trunk
from turbo.options import OpenOptions

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native library unavailable: {native.why_not()}")

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
    if "pairs" not in native.dot_layouts():
        pytest.skip("this CPU has no AVX512-BF16")
    return turbo.open(spec_install[1], backend="cpu", dtype="bfloat16")


def test_bf16_compute_takes_the_bf16_dot_products(bf16_rt, spec_install):
    trunk = bf16_rt.trunk
    assert trunk.step_name == "native"
    assert all(m.layout == "pairs" for m in (trunk.layers[0].gate_up, trunk.layers[0].down, trunk.lm_head))
    fp32 = turbo.open(spec_install[1], backend="cpu").trunk  # fp32 compute: the exact products, unchanged
    assert fp32.lm_head.layout == "panels" and fp32.layers[0].gate_up.layout == "panels"


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_bf16_verify_rows_are_decode_steps(bf16_rt, threads):
    g = torch.Generator().manual_seed(threads)
    vocab = bf16_rt.trunk.arch.vocab
    prompt, tokens = torch.randint(0, vocab, (9,), generator=g).tolist(), torch.randint(0, vocab, (12,), generator=g)
    assert_rows_are_steps(bf16_rt.trunk, prompt, tokens.tolist())


def test_bf16_speculation_is_lossless(bf16_rt):
    from helpers import assert_lossless

    prompt = list(range(5, 30))
    plain = bf16_rt.generate(prompt, max_new_tokens=20, policy="off", stop_at_eos=False).tokens
    for block in (1, 3, 8):
        for rollback in ("checkpoint", "replay"):
            assert_lossless(bf16_rt, prompt, plain, block, max_new_tokens=20, stop_at_eos=False, rollback=rollback)


def test_a_tied_embedding_in_pairs_is_read_exactly(tmp_path):
    if "pairs" not in native.dot_layouts():
        pytest.skip("this CPU has no AVX512-BF16")
    model, path = make_install(tmp_path, 3, tie_word_embeddings=True, hidden_size=72, head_dim=18)
    trunk = load_trunk(open_install(path), OpenOptions(dtype="bfloat16"), "cpu")
    assert isinstance(trunk.embed, native.PackedRows) and trunk.lm_head.layout == "pairs"
    table = model.model.embed_tokens.weight.detach().bfloat16()
    ids = [0, 1, 15, 16, 17, table.shape[0] - 1]  # across panels, and the last (padded) one
    assert torch.equal(trunk.embed[torch.tensor(ids)], table[ids])
    row_major = load_trunk(open_install(path), OpenOptions(dtype="bfloat16"), "cpu")
    row_major.embed = table.clone()  # a table of its own: the step reads the same rows
    out, ref = trunk.step(trunk.new_state(16), ids), row_major.step(row_major.new_state(16), ids)
    assert torch.equal(out.logits, ref.logits)
    assert torch.equal(ops.dense(trunk.lm_head), table)

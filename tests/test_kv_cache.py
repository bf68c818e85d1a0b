"""The K/V cache in bf16 (OpenOptions.kv_cache): rows rounded to nearest even as they are
written, read widened, the sums in the fp32 cache's order -- so a verify row still equals its
decode step bit for bit, speculation stays lossless, and greedy decoding stays close to the
fp32 cache's."""

import copy

import pytest
import torch

import turbo
from turbo.backends import native_lib
from turbo.errors import TurboError
from turbo.load.load_plan import kv_dtype
from turbo.load.loader import load_trunk
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install

PROMPT = [(13 * i) % 300 + 3 for i in range(40)]


def trunk_of(path, **opts):
    return load_trunk(open_install(path), OpenOptions.from_env(**opts), "cpu")


def test_auto_is_the_checkpoints_precision(plain_install):
    tiny, plain = trunk_of("tiny"), trunk_of(plain_install[1])  # tiny is a bf16 checkpoint, plain fp32
    assert (tiny.kv_dtype, plain.kv_dtype) == (torch.bfloat16, torch.float32)
    assert trunk_of("tiny", kv_cache="float32").kv_dtype == torch.float32
    assert trunk_of(plain_install[1], kv_cache="bfloat16").kv_dtype == torch.bfloat16
    k, v = tiny.new_state(64).kv[tiny.arch.full_layers[0]]
    assert k.dtype == v.dtype == torch.bfloat16 and k.nbytes == 2 * k.numel()
    # cuda keeps fp32 under auto (its step has not run a bf16 cache on a GPU); asked for, bf16
    cuda = torch.device("cuda")
    assert kv_dtype("auto", cuda, torch.float32, {"BF16"}, False) == torch.float32
    assert kv_dtype("bfloat16", cuda, torch.float32, {"F32"}, False) == torch.bfloat16
    assert kv_dtype("auto", torch.device("cpu"), torch.float32, {"F32"}, True) == torch.bfloat16  # quantized


def test_a_bad_value_is_one_error_naming_the_choices():
    with pytest.raises(TurboError, match=r"^kv_cache 'float16' is not one of auto, float32, bfloat16$"):
        OpenOptions(kv_cache="float16")


def verifies_equal_steps(trunk, st, max_rows: int = 12) -> list[torch.Tensor]:
    """From `st`, a verify of R rows against R decode steps from a copy of the same state,
    R = 1..max_rows (st advances by the verifies): hidden states, logits and caches equal bit for
    bit. Returns each verify's logits and the first full layer's caches after it."""
    out = []
    for rows in range(1, max_rows + 1):
        tokens = [(11 * rows + 5 * j) % 300 + 3 for j in range(rows)]
        single = copy.deepcopy(st)
        verify = trunk.step(st, tokens, (), "checkpoint")
        steps = [trunk.step(single, [t], (), None) for t in tokens]
        assert torch.equal(verify.hidden, torch.cat([s.hidden for s in steps])), rows
        assert torch.equal(verify.logits, torch.cat([s.logits for s in steps])), rows
        assert all(torch.equal(a, b) for i in st.kv for a, b in zip(st.kv[i], single.kv[i]))
        out += [verify.logits, *st.kv[trunk.arch.full_layers[0]]]
    return out


def rows_and_steps(threads: int, path="tiny", prompt_len: int = 1400, **opts) -> list[torch.Tensor]:
    """On `threads` threads, after a prompt (1400 tokens on tiny: a 12-row verify's attention
    splits over two threads), the prefill's logits and verifies_equal_steps."""
    torch.set_num_threads(threads)
    try:
        trunk = trunk_of(path, native=True, **opts)
        st = trunk.new_state(prompt_len + 100)
        prompt = [(7 * i) % 300 + 3 for i in range(prompt_len)]
        return [trunk.prefill(st, prompt, want_logits=True).logits, *verifies_equal_steps(trunk, st)]
    finally:
        torch.set_num_threads(1)


def test_native_verify_rows_equal_decode_steps_and_threads_agree():
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    one, two = rows_and_steps(1, kv_cache="bfloat16"), rows_and_steps(2, kv_cache="bfloat16")
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


@pytest.mark.parametrize("kv_cache", ["float32", "bfloat16"])
def test_verify_rows_equal_decode_steps_at_an_odd_head_shape(tmp_path, kv_cache):
    """Three query heads a kv head (scores run four queries at a time: a head's row falls in a
    quad or outside one depending on the row count) and head_dim 24 (a tail past the 16 lanes)."""
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    from turbo.testing import make_install

    _, path = make_install(tmp_path, seed=3, num_attention_heads=6, num_key_value_heads=2, head_dim=24)
    trunk = trunk_of(path, kv_cache=kv_cache, native=True)
    st = trunk.new_state(200)
    trunk.prefill(st, [(7 * i) % 300 + 3 for i in range(61)])
    verifies_equal_steps(trunk, st)


@pytest.mark.parametrize("drafter", ["dflash", "mtp", "ngram"])
def test_speculation_is_lossless_with_a_bf16_cache(drafter, step_path):
    rt = turbo.open("tiny", backend="cpu", kv_cache="bfloat16")
    assert rt.trunk.step_name == step_path and rt.trunk.kv_dtype == torch.bfloat16
    prompt = PROMPT + PROMPT[:20]  # a repeat: ngram finds matches
    plain = rt.generate(prompt, max_new_tokens=30, policy="off", stop_at_eos=False).tokens
    rollbacks = 0
    for rollback in ("checkpoint", "replay"):
        for block in (1, 3, 8):
            out = rt.generate(prompt, max_new_tokens=30, policy="fixed", block=block, drafter=drafter,
                              rollback=rollback, stop_at_eos=False)
            assert out.tokens == plain, (rollback, block)
            assert out.stats.drafter == drafter and out.stats.drafted > 0
            rollbacks += out.stats.rollbacks
    assert rollbacks > 0  # rejected rounds restored the state: both rollbacks ran
    if drafter == "mtp":
        assert rt.drafter("mtp", None).k.dtype == torch.bfloat16  # the head's own cache follows the trunk's


def first_logits_and_greedy(path, kv_cache: str, native_step: bool, n: int = 48):
    trunk = trunk_of(path, kv_cache=kv_cache, native=native_step)
    st = trunk.new_state(700)
    prompt = [(13 * i) % 300 + 3 for i in range(600)]
    logits = trunk.prefill(st, prompt, want_logits=True).logits
    tokens = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        tokens.append(int(trunk.step(st, tokens[-1:]).logits[-1].argmax()))
    return logits, tokens


@pytest.mark.parametrize("native_step", [True, False], ids=["native", "torch"])
def test_greedy_decoding_stays_close_to_the_fp32_cache(native_step):
    """tiny after 600 prompt tokens: measured 0.008 at most over every prompt row's logits
    (their largest is ~12) on both steps, and the same 48 greedy tokens."""
    if native_step and native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    a, ta = first_logits_and_greedy("tiny", "float32", native_step)
    b, tb = first_logits_and_greedy("tiny", "bfloat16", native_step)
    assert not torch.equal(a, b)  # (the cache is really bf16)
    assert (a - b).abs().max() < 0.03
    assert ta == tb


def test_the_native_and_torch_steps_agree_on_a_bf16_cache(exact_bf16):
    """Each step rounds its own K/V: where the two steps' fp32 values differ in the last ulp,
    a rounded value may land one bf16 step apart. Measured 4e-4 at most (fp32 cache: 1.5e-5).
    The native step's exact bf16 products (the fp32 walk): AMX's round the inputs to bf16."""
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    (a, ta), (b, tb) = (first_logits_and_greedy("tiny", "bfloat16", s, n=16) for s in (True, False))
    assert (a - b).abs().max() < 2e-3
    assert ta == tb


def test_amx_products_stay_close_to_the_torch_step():
    """The native step's AMX bf16 products (inputs rounded to bf16 at each product) against the torch
    step's fp32 activations, tiny after 600 prompt tokens: measured 0.043 at most over every prompt
    row's logits (their largest ~12), and the same greedy tokens."""
    if native_lib.library() is None or not native_lib.library().bf16_products(-1):
        pytest.skip("no AMX-BF16 products here")
    (a, ta), (b, tb) = (first_logits_and_greedy("tiny", "bfloat16", s, n=16) for s in (True, False))
    assert (a - b).abs().max() < 0.1
    assert ta == tb


def test_rows_split_over_threads_at_a_wide_shape(tmp_path):
    """Conv, norms and activations 2048 wide: from 8 rows a verify's row loops split over two
    threads (native.c row_parts), and each row is still a decode step, whatever the split."""
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    from turbo.testing import make_install

    _, path = make_install(tmp_path, seed=5, linear_num_key_heads=4, linear_key_head_dim=128,
                           linear_num_value_heads=8, linear_value_head_dim=128, intermediate_size=2048,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=256)
    one, two = rows_and_steps(1, path, 70), rows_and_steps(2, path, 70)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))

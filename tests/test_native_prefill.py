"""The native prefill runs the prompt as chunks of rows through the step: every row equals
the one-row decode step it stands for, bit for bit -- also past 4096 cached positions, where
attention takes a chunk's rows in blocks to bound its scores."""

import pytest
import torch

from turbo.backends import native_lib, native_trunk
from turbo.load.loader import load_trunk
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install


@pytest.mark.parametrize("kv_cache", ["float32", "bfloat16"])
def test_prefill_rows_equal_decode_steps(plain_install, kv_cache):
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    trunk = load_trunk(open_install(plain_install[1]), OpenOptions(kv_cache=kv_cache), "cpu")
    # tiny has 4 query heads: past 4096 keys a chunk's scores take two blocks
    n, rows = 4200, native_trunk.PREFILL_CHUNK
    tokens = [(13 * i) % 300 + 3 for i in range(n)]
    a, b = trunk.new_state(n), trunk.new_state(n)
    head = trunk.prefill(a, tokens[:n - rows])
    assert torch.equal(head.hidden, trunk.prefill(b, tokens[:n - rows]).hidden)
    chunk = trunk.step(a, tokens[n - rows:], (), None)  # the rows as the prefill's last chunk runs them
    steps = [trunk.step(b, [t], (), None) for t in tokens[n - rows:]]
    assert torch.equal(chunk.hidden, torch.cat([s.hidden for s in steps]))
    assert torch.equal(chunk.logits, torch.cat([s.logits for s in steps]))


@pytest.mark.parametrize("kv_cache", ["float32", "bfloat16"])
def test_a_verify_sized_call_and_a_chunk_sum_v_the_same_way(kv_cache):
    """tiny (head_dim 64): a one-row step sums V row by row for its few queries (weighted_sums),
    a prefill chunk of many rows strip by strip (weighted_sum); the bits are the same, from an
    fp32 cache or a bf16 one."""
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    trunk = load_trunk(open_install("tiny"), OpenOptions(kv_cache=kv_cache), "cpu")
    chunk, steps = chunk_and_steps(trunk, 1200, native_trunk.PREFILL_CHUNK)
    assert torch.equal(chunk.hidden, torch.cat([s.hidden for s in steps]))


def chunk_and_steps(trunk, n: int, rows: int):
    """After the same n - rows tokens prefilled, the last `rows` as one call and as decode steps."""
    tokens = [(13 * i) % 300 + 3 for i in range(n)]
    a, b = trunk.new_state(n), trunk.new_state(n)
    trunk.prefill(a, tokens[:n - rows]), trunk.prefill(b, tokens[:n - rows])
    return trunk.step(a, tokens[n - rows:], (), None), [trunk.step(b, [t], (), None) for t in tokens[n - rows:]]


@pytest.mark.parametrize("heads,kv_cache", [(8, "bfloat16"), (6, "float32")])
def test_a_long_chunk_at_head_dim_256_equals_decode_steps(tmp_path, heads, kv_cache):
    """head_dim 256 (Qwen3.5's) with 4 or 3 query heads a kv head: a chunk's many queries sum V
    four at a time (with 3 heads a quad spans two rows, which see different key counts), and
    each row still equals its decode step bit for bit."""
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    from turbo.testing import make_install

    _, path = make_install(tmp_path, seed=5, num_attention_heads=heads, num_key_value_heads=2, head_dim=256)
    trunk = load_trunk(open_install(path), OpenOptions(kv_cache=kv_cache), "cpu")
    chunk, steps = chunk_and_steps(trunk, 300, 61)
    assert torch.equal(chunk.hidden, torch.cat([s.hidden for s in steps]))
    assert torch.equal(chunk.logits, torch.cat([s.logits for s in steps]))

"""The native step's numbers do not depend on the thread count: products split by output,
attention by kv head and the delta rule by value head, each computed whole by one thread."""

import pytest
import torch

from turbo.backends import native_lib
from turbo.load.loader import load_trunk
from turbo.sequence.options import OpenOptions
from turbo.store.install import open_install


def run(path, threads: int, kv_cache: str) -> list[torch.Tensor]:
    """A prefill long enough that attention and the recurrence split, then a 5-row verify."""
    torch.set_num_threads(threads)
    try:
        trunk = load_trunk(open_install(path), OpenOptions(kv_cache=kv_cache), "cpu")
        st = trunk.new_state(400)
        prompt = [(7 * i) % 200 + 3 for i in range(300)]
        first = trunk.prefill(st, prompt, want_logits=True)
        verify = trunk.step(st, [5, 9, 11, 13, 17], (), "checkpoint")
        return [first.logits, verify.logits, *verify.traces[0].states, st.kv[3][0]]
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("kv_cache", ["float32", "bfloat16"])
def test_one_and_two_threads_agree_bit_for_bit(plain_install, kv_cache):
    if native_lib.library() is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    one, two = run(plain_install[1], 1, kv_cache), run(plain_install[1], 2, kv_cache)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))

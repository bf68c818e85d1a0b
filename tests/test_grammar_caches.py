"""The runtime's grammar caches are bounded (issue 57): a client that names a new set of stop ids
or a new schema with every request cannot grow the engine (scripts/rss_grammar.py measured 3.2 MiB
per set of stop ids on tiny, kept for ever before)."""

from __future__ import annotations

import pytest

import turbo
from turbo.sequence.grammar import COMPILED_KEPT, VOCABS_KEPT, Kept

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def rt():
    return turbo.open("tiny", backend="cpu", threads=1)


def test_vocabularies_per_set_of_stop_ids_are_kept_lru(rt):
    fmt = {"type": "json_object"}
    for i in range(3 * VOCABS_KEPT):
        out = rt.generate("{", max_new_tokens=2, policy="off", response_format=fmt, stop_token_ids=[10 + i])
        assert out.tokens
    assert len(rt.grammars.tokenizers) == VOCABS_KEPT
    assert tuple(sorted({*rt.install.eos_ids, 10 + 3 * VOCABS_KEPT - 1})) in rt.grammars.tokenizers  # the latest


def test_compiled_grammars_are_bounded_in_count_and_bytes(rt):
    for i in range(COMPILED_KEPT + 8):
        rt.generate("x", max_new_tokens=1, policy="off", response_format={"type": "regex", "regex": f"a{i}b"})
    assert len(rt.grammars.compiled) == COMPILED_KEPT
    kept = Kept(10, most_bytes=100, size=len)
    for i in range(5):
        kept.keep(i, "x" * 40)
    assert list(kept) == [3, 4] and kept.bytes == 80
    assert kept.used(3) == "x" * 40 and list(kept) == [4, 3]  # (used: now the most recent)
    kept.keep("big", "y" * 500)  # one entry over the bound alone is kept, the rest dropped
    assert list(kept) == ["big"] and kept.bytes == 500

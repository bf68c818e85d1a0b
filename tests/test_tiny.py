"""The embedded default install: it ships, it loads, and every policy reproduces its golden."""

import itertools
import json
from pathlib import Path

import pytest

import turbo
from turbo.store.install import BUNDLED_DIR, open_install

GOLDEN = json.loads((Path(__file__).parent / "golden" / "tiny.json").read_text())


@pytest.fixture(scope="module")
def rt():
    return turbo.open("tiny", backend="cpu")


def test_shipped_inside_the_package_with_both_drafters():
    inst = open_install("tiny")
    assert inst.path == BUNDLED_DIR / "tiny"
    assert "dflash.fc.weight" in inst.index and inst.has_dflash
    assert inst.has_mtp and not inst.has_vision
    assert all(e.dtype == 1 for n, e in inst.index.entries.items())  # bf16 weights
    size = sum(f.stat().st_size for f in inst.path.rglob("*") if f.is_file())
    assert size < 64 * 1024 * 1024


def run(rt, **kw):
    return rt.generate(GOLDEN["prompt"], max_new_tokens=GOLDEN["max_new_tokens"], stop_at_eos=False, **kw)


def test_off_and_auto_reproduce_the_golden(rt):
    assert run(rt, policy="off").tokens == GOLDEN["tokens"]
    auto = run(rt, policy="auto")
    assert auto.tokens == GOLDEN["tokens"]
    assert auto.stats.drafter == "dflash" and auto.stats.block == 2 and auto.stats.accepted > 0


@pytest.mark.parametrize("block", range(1, 9))
def test_fixed_blocks_reproduce_the_golden(rt, block):
    for drafter, rollback in itertools.product(("dflash", "mtp"), ("checkpoint", "replay")):
        out = run(rt, policy="fixed", block=block, drafter=drafter, rollback=rollback)
        assert out.tokens == GOLDEN["tokens"], (drafter, rollback, block)
        assert out.stats.accepted > 0


@pytest.mark.parametrize("drafter", ["dflash", "mtp", "ngram"])
def test_temperature_zero_is_greedy_whatever_the_other_sampling_fields(rt, drafter):
    for block in (1, 2, 4, 8):
        out = run(rt, policy="fixed", block=block, drafter=drafter, temperature=0.0, top_k=3, top_p=0.5, min_p=0.2,
                  seed=block)
        assert out.tokens == GOLDEN["tokens"], (drafter, block)
        assert out.stats.seed is None  # no generator: the greedy path itself


def test_window_is_refused_for_the_mtp_head(rt):
    with pytest.raises(turbo.TurboError, match="window 64"):
        rt.generate("x", max_new_tokens=2, policy="fixed", block=2, drafter="mtp", window=64)
    assert run(rt, policy="fixed", block=2, drafter="dflash", window=64).tokens == GOLDEN["tokens"]


def test_round_texts_add_up_to_the_text_without_broken_characters(rt):
    from turbo.sequence.detokenizer import Detokenizer

    s = "naïve café — 𝛑 ≈ 3.14159; 日本語のテキスト 🙂 end"
    ids = rt.encode(s)
    for step in (1, 2, 3):  # rounds of 1..3 tokens: multi-byte characters split across rounds
        d = Detokenizer(rt.decode)
        parts = [d.push(ids[i:i + step], final=i + step >= len(ids)) for i in range(0, len(ids), step)]
        assert "".join(parts) == rt.decode(ids) == s
        assert not any("\ufffd" in p for p in parts)
    events = list(rt.stream("def fibonacci(n):\n    ", max_new_tokens=40, policy="fixed", block=4))
    assert "".join(e.text for e in events) == rt.decode([t for e in events for t in e.tokens])

"""max_new_tokens is a limit, not an allocation: a generation's K/V cache holds its prompt plus a
chunk and grows with the sequence (turbo.model.trunk.KV_CHUNK, Trunk.reserve), with the tokens a cache
reserved whole up front gives."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import turbo
from turbo.errors import TurboError
from turbo.model.trunk import KV_CHUNK
from turbo.sequence.state_cache import Keeper, StateCache

TINY = Path(turbo.__file__).parent / "installs" / "tiny"
POSITIONS = 2 ** 20  # a cache reserved for all of them: 2 layers x 2 x 2^20 x 2 heads x 64 x 2 B = 1 GiB
PROMPT = "def fib(n):"


def long_context_install(tmp: Path, positions: int) -> Path:
    """The shipped tiny install with a context of `positions` (default RoPE: irrelevant to the forward)."""
    out = tmp / f"tiny-{positions}"
    out.mkdir()
    for f in TINY.iterdir():
        (out / f.name).symlink_to(f)
    (out / "config.json").unlink()
    config = json.loads((TINY / "config.json").read_text()) | {"max_position_embeddings": positions}
    (out / "config.json").write_text(json.dumps(config))
    return out


class Recording(Keeper):
    """A start that keeps nothing but the state it began (and may reserve more than asked)."""

    def __init__(self, at_least: int = 0):
        super().__init__(StateCache(0), live=False)
        self.at_least, self.st = at_least, None

    def fresh(self, trunk, capacity):
        self.st = super().fresh(trunk, max(capacity, self.at_least))
        return self.st


def run(rt, max_new: int, tokens: int, start: Recording, **kw) -> list[int]:
    """The first `tokens` tokens of a stream asked for up to `max_new` (closed there)."""
    out: list[int] = []
    stream = rt.stream(PROMPT, max_new_tokens=max_new, stop_at_eos=False, keeper=start, **kw)
    for event in stream:
        out += event.tokens
        if len(out) >= tokens:
            break
    stream.close()
    return out[:tokens]


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    return turbo.open(str(long_context_install(tmp_path_factory.mktemp("mem"), POSITIONS)))


@pytest.mark.parametrize("kw", [dict(policy="off"), dict(policy="fixed", block=4, drafter="ngram")],
                         ids=["plain", "speculative"])
def test_a_huge_max_new_tokens_reserves_what_the_generation_uses(rt, kw):
    n = KV_CHUNK + 80  # past the first chunk: the cache grows mid-generation
    grown, whole = Recording(), Recording(at_least=POSITIONS // 1024)
    tokens = run(rt, POSITIONS - 64, n, grown, **kw)
    assert tokens == run(rt, n, n, whole, **kw) == rt.generate(PROMPT, max_new_tokens=n, stop_at_eos=False,
                                                                 **kw).tokens
    used = grown.st.pos  # the prompt, the n tokens, a round's rows past them at most
    assert n < used < n + 40
    for k, v in grown.st.kv.values():
        assert used <= k.shape[1] == v.shape[1] <= 2 * used  # doubled at most once past what it used
    assert all(k.shape[1] == POSITIONS // 1024 for k, _ in whole.st.kv.values())  # (the reference never grew)


def test_peak_rss_does_not_follow_max_new_tokens(tmp_path):
    """In a fresh process: a generation asked for 2^20 - 64 tokens that stops after 8 raises the
    peak RSS by what 8 tokens use, not the 1 GiB a cache reserved for them would take."""
    path = long_context_install(tmp_path, POSITIONS)
    code = textwrap.dedent(f"""
        import resource, turbo
        rt = turbo.open({str(path)!r})
        rt.generate({PROMPT!r}, max_new_tokens=8, stop_at_eos=False, policy="off")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for event in rt.stream({PROMPT!r}, max_new_tokens={POSITIONS - 64}, stop_at_eos=False, policy="off"):
            break
        print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, after = map(int, out.stdout.split())
    assert after - before < 64 * 1024, (before, after)  # KiB: under 64 MiB


def test_the_trainer_refuses_a_data_path_past_its_bound_before_reading(tmp_path):
    from turbo.train import data

    big = tmp_path / "huge.txt"
    with big.open("wb") as f:  # sparse: a byte past the bound, nothing written
        f.truncate(data.MAX_GROUP_BYTES + 1)
    with pytest.raises(TurboError, match=r"huge.txt: 1.0 GiB of data, over the 1 GiB"):
        data.read_groups([str(big)], lambda text: pytest.fail("read the data"))

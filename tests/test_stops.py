"""Stop strings and stop token ids (turbo.sequence.stops) on tiny: every expectation is read off a run
without stops. A stopped run's tokens are the shortest prefix of that run whose text holds
the stop string, its text is that run's text cut right before it, and a stop that completes
inside a speculative block commits exactly up to it, with the state and the drafter exactly
where a round accepting only that far leaves them."""

from pathlib import Path

import pytest

import turbo
from turbo import engine
from turbo.errors import TurboError
from turbo.sequence.stops import Finish, Stopper
from turbo.testing.checks import play_round

CODE = "def fib(n):"  # the DFlash drafter lands here
REPEAT = "import os\nimport sys\n" * 3  # and the n-gram drafter here (a prompt tiny does not answer with <|im_end|>)
NEW = 24
SPEC = [("dflash", CODE), ("ngram", REPEAT)]
BLOCKS = range(2, 9)


@pytest.fixture(scope="module")
def rt():
    return turbo.open("tiny", backend="cpu")


@pytest.fixture(scope="module")
def greedy(rt):
    return {p: rt.generate(p, max_new_tokens=NEW, policy="off").tokens for p in (CODE, REPEAT)}


@pytest.fixture
def cuts(monkeypatch):
    """(tokens the round would commit, how many the stop kept) for every round the engine plays."""
    seen, real = [], Stopper.cut

    def watched(self, tokens):
        keep = real(self, tokens)
        seen.append((len(tokens), keep))
        return keep

    monkeypatch.setattr(Stopper, "cut", watched)
    return seen


def expected(rt, tokens: list[int], stop: str) -> tuple[list[int], str]:
    """The shortest prefix of `tokens` whose text holds `stop`, and their text cut before it."""
    k = next(k for k in range(1, len(tokens) + 1) if stop in rt.decode(tokens[:k]))
    text = rt.decode(tokens)
    return tokens[:k], text[:text.index(stop)]


def spanning(rt, tokens: list[int], k: int) -> str:
    """A stop string that spans a token boundary and first completes at token k (1-based): it
    ends with token k's first character and reaches back as far as it must to be new there."""
    before = len(rt.decode(tokens[:k - 1]))
    text = rt.decode(tokens)
    for length in range(2, before + 2):
        stop = text[before + 1 - length:before + 1]
        if len(expected(rt, tokens, stop)[0]) == k:
            return stop
    raise AssertionError(f"no stop string first completes at token {k}")


def check(rt, prompt: str, reference: list[int], stop, want_tokens, want_text, **kw):
    """The stopped run: its tokens, its text (whole and as the events streamed it), its finish."""
    events = list(rt.stream(prompt, max_new_tokens=NEW, stop=stop, **kw))
    tokens = [t for e in events for t in e.tokens]
    assert tokens == want_tokens and tokens == reference[:len(tokens)]
    assert "".join(e.text for e in events) == want_text  # nothing past the cut was ever emitted
    last = events[-1]
    assert last.done and last.finish.reason == "stop" and [e.finish for e in events[:-1]] == [None] * (len(events) - 1)
    assert last.stats.generated_tokens == len(tokens)
    # every committed proposal is flagged; the counters keep the trunk's verdict, which may
    # count proposals it confirmed past the stop (they were landed, not committed)
    assert last.stats.accepted >= sum(f for e in events for f in e.from_draft)
    assert all(e.from_draft == [True] * len(e.from_draft[:-1]) + e.from_draft[-1:] for e in events if e.from_draft)
    result = rt.generate(prompt, max_new_tokens=NEW, stop=stop, **kw)
    assert (result.tokens, result.text, result.finish) == (tokens, want_text, last.finish)
    return last.finish


@pytest.mark.parametrize("k", [2, 5, 11])
def test_a_stop_string_split_across_tokens(rt, greedy, k):
    stop = spanning(rt, greedy[CODE], k)
    want_tokens, want_text = expected(rt, greedy[CODE], stop)
    assert len(want_tokens) == k
    assert check(rt, CODE, greedy[CODE], stop, want_tokens, want_text, policy="off") == Finish("stop", stop)


def rounds(rt, prompt: str, **kw) -> list[int]:
    return [len(e.tokens) for e in rt.stream(prompt, max_new_tokens=NEW, **kw)]


def inside(sizes: list[int]) -> int:
    """A token (1-based) that a round commits with accepted tokens after it: in the widest round."""
    widest = max(range(len(sizes)), key=sizes.__getitem__)
    start, n = sum(sizes[:widest]), sizes[widest]
    m = max(n // 2, 2 - start)  # a stop string spanning a boundary needs a token before it
    assert m < n, sizes
    return start + m


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("drafter,prompt", SPEC, ids=[d for d, _ in SPEC])
def test_a_stop_string_inside_an_accepted_block(rt, greedy, cuts, drafter, prompt, block):
    spec = dict(policy="fixed", block=block, drafter=drafter)
    k = inside(rounds(rt, prompt, **spec))
    stop = spanning(rt, greedy[prompt], k)
    want_tokens, want_text = expected(rt, greedy[prompt], stop)
    cuts.clear()
    check(rt, prompt, greedy[prompt], stop, want_tokens, want_text, **spec)
    offered, kept = cuts[-1]
    assert kept is not None and kept < offered  # the block's accepted tokens after the stop: not committed


def drive(rt, prompt: str, drafter: str, block: int, rollback: str, stop_at: int) -> tuple[list[int], int]:
    """Greedy rounds played as the engine plays them, one cut to end at token `stop_at`, then
    on uncut: the tokens, and the length at the cut."""
    ids, trunk, draft = rt.encode(prompt), rt.trunk, rt.drafter(drafter, None)
    st = trunk.new_state(len(ids) + NEW + 16)
    draft.begin(trunk.prefill(st, ids[:-1], draft.aux_layers), ids)
    got, anchor, at = [], ids[-1], None
    while len(got) < NEW:
        start = len(got)
        cut = lambda toks: stop_at - start if start < stop_at < start + len(toks) else None  # noqa: E731
        r = play_round(trunk, st, draft, anchor, block, rollback, None, cut)
        got += r.proposals[:r.accepted] + [r.bonus]
        at = len(got) if start < stop_at <= len(got) else at
        anchor = r.bonus
    return got[:NEW], at


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
@pytest.mark.parametrize("block", [3, 8])
@pytest.mark.parametrize("drafter,prompt", SPEC, ids=[d for d, _ in SPEC])
def test_a_cut_round_leaves_the_state_and_drafter_exact(rt, greedy, drafter, prompt, block, rollback):
    """After a round cut inside its block, generation goes on exactly as greedy: the trunk
    state and the drafter hold what a round accepting only that far leaves."""
    k = inside(rounds(rt, prompt, policy="fixed", block=block, drafter=drafter))
    tokens, at = drive(rt, prompt, drafter, block, rollback, k)
    assert at == k and tokens == greedy[prompt]


def test_a_sampled_stop_matches_the_same_seed_without_stops(rt, cuts):
    spec = dict(policy="fixed", block=4, drafter="dflash", temperature=1.0, seed=7)
    events = list(rt.stream(CODE, max_new_tokens=NEW, **spec))
    reference = [t for e in events for t in e.tokens]
    k = inside([len(e.tokens) for e in events])
    stop = spanning(rt, reference, k)
    want_tokens, want_text = expected(rt, reference, stop)
    cuts.clear()
    check(rt, CODE, reference, stop, want_tokens, want_text, **spec)
    assert cuts[-1][1] < cuts[-1][0]


@pytest.mark.parametrize("spec", [dict(policy="off"), dict(policy="fixed", block=4, drafter="dflash"),
                                  dict(policy="fixed", block=4, drafter="ngram")], ids=["off", "dflash", "ngram"])
@pytest.mark.parametrize("prompt", [CODE, REPEAT], ids=["code", "repeat"])
def test_a_stop_string_at_the_first_token(rt, greedy, prompt, spec):
    stop = rt.decode(greedy[prompt][:1])[:2]
    assert check(rt, prompt, greedy[prompt], stop, greedy[prompt][:1], "", **spec) == Finish("stop", stop)


def test_a_stop_string_begun_but_never_completed_is_released(rt, greedy):
    text, boundary = rt.decode(greedy[CODE]), len(rt.decode(greedy[CODE][:6]))
    stop = text[boundary - 4:boundary] + "\u2603"  # the text after token 6 ends with its first 4 characters
    events = list(rt.stream(CODE, max_new_tokens=NEW, policy="off", stop=["\u2603\u2603", stop]))
    assert [t for e in events for t in e.tokens] == greedy[CODE] and events[-1].finish == Finish("length")
    assert "".join(e.text for e in events) == text  # released when the match failed
    assert len("".join(e.text for e in events[:6])) == boundary - 4  # held while it might still complete


@pytest.mark.parametrize("spec", [dict(policy="off"), dict(policy="fixed", block=4, drafter="ngram")])
def test_stop_token_ids(rt, greedy, spec):
    tokens = greedy[REPEAT]
    j = tokens.index(tokens[6])
    events = list(rt.stream(REPEAT, max_new_tokens=NEW, stop_token_ids=[tokens[6]], **spec))
    assert [t for e in events for t in e.tokens] == tokens[:j + 1]  # the stop token is committed
    assert "".join(e.text for e in events) == rt.decode(tokens[:j])  # and its text not emitted
    assert events[-1].finish == Finish("stop", tokens[6])


def test_several_stop_strings_the_earliest_wins(rt, greedy):
    late, early = spanning(rt, greedy[CODE], 12), spanning(rt, greedy[CODE], 4)
    want_tokens, want_text = expected(rt, greedy[CODE], early)
    assert check(rt, CODE, greedy[CODE], [late, early], want_tokens, want_text, policy="off") == Finish("stop", early)


def test_stop_strings_with_stop_at_eos(rt):
    prompt, eos = "<|endoftext|>", rt.install.arch.eos_token_ids[0]
    plain = rt.generate(prompt, max_new_tokens=64, policy="off")
    assert plain.tokens[-1] == eos and plain.finish == Finish("stop", eos)
    assert plain.text == rt.decode(plain.tokens[:-1])  # eos is committed, its text is not emitted
    missing = rt.generate(prompt, max_new_tokens=64, policy="off", stop=["\u2603"])
    assert (missing.tokens, missing.text, missing.finish) == (plain.tokens, plain.text, plain.finish)
    as_id = rt.generate(prompt, max_new_tokens=64, policy="off", stop_at_eos=False, stop_token_ids=[eos])
    assert (as_id.tokens, as_id.text, as_id.finish) == (plain.tokens, plain.text, plain.finish)
    stop = spanning(rt, plain.tokens, 6)
    want_tokens, want_text = expected(rt, plain.tokens, stop)
    first = rt.generate(prompt, max_new_tokens=64, policy="off", stop=stop)
    assert (first.tokens, first.text, first.finish) == (want_tokens, want_text, Finish("stop", stop))


@pytest.mark.parametrize("fields,message", [
    (dict(stop=""), "stop is ''"), (dict(stop=["ab", ""]), "stop is"), (dict(stop=[1]), "stop is"),
    (dict(stop=5), "stop is 5"), (dict(stop={"a": 1}), "stop is"),
    (dict(stop_token_ids=[-1]), "stop_token_ids is"), (dict(stop_token_ids="3"), "stop_token_ids is"),
    (dict(stop_token_ids=[True]), "stop_token_ids is"), (dict(stop_token_ids=3), "stop_token_ids is"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids is"), (dict(stop_token_ids=[10 ** 9]), "not an id in"),
])
def test_invalid_stop_options_are_refused_in_one_line(rt, fields, message):
    with pytest.raises(TurboError, match=message) as e:
        rt.generate(CODE, max_new_tokens=2, **fields)
    assert "\n" not in str(e.value)


def test_the_cli_config_passes_stops():
    from hydra import compose, initialize_config_dir

    from turbo.config import run_config

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        many = run_config(compose(config_name="config", overrides=["stop=[ab,'c d']", "stop_token_ids=[3,5]"]))
        one = run_config(compose(config_name="config", overrides=["stop=ab"]))
    assert many.generation.stop == ("ab", "c d") and many.generation.stop_token_ids == (3, 5)
    assert one.generation.stop == ("ab",) and one.generation.stop_token_ids is None

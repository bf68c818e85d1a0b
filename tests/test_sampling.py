"""Sampling: the processing, the seed, and lossless speculative sampling for every drafter kind.

The statistical checks compare the empirical distribution of the first K committed tokens
with the exact target distribution (the plain path's: the processed softmax of the trunk's
logits, chained over K tokens) by a chi-square goodness-of-fit test at significance ALPHA.
The seeds are fixed, so every check is deterministic; a correct rule fails one with
probability ALPHA per seed choice, and a wrong rule (the negative controls) fails it.
"""

import json
import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_mtp import add_mtp, mtp_tensors
from test_penalties import reference_row

import turbo
from turbo import engine
from turbo.drafters import DrafterBase
from turbo.drafters.ngram import NgramDrafter
from turbo.errors import TurboError
from turbo.repack import repack
from turbo.sequence.grammar import GrammarState
from turbo.sequence.options import GenerationOptions
from turbo.sequence.penalties import PenaltyState
from turbo.sequence.sampling import RejectionSampler, Sampler, SamplingParams, probabilities, rejection_sampler
from turbo.testing import ScriptedDrafter, hf_config, make_drafter, make_published_dflash, randomize_
from turbo.testing.checks import play_round

ALPHA = 1e-3
Z_ALPHA = 3.0902  # the standard normal's 1 - ALPHA quantile
K = 2  # committed tokens compared
BLOCKS = (1, 2, 4, 8)


def chi_square_critical(df: int) -> float:
    """The chi-square(df) 1 - ALPHA quantile (Wilson-Hilferty: within 1% for df >= 3)."""
    a = 2 / (9 * df)
    return df * (1 - a + Z_ALPHA * math.sqrt(a)) ** 3


def fits(samples: list[tuple[int, ...]], expected: dict[tuple[int, ...], float]) -> bool:
    """Chi-square goodness of fit at ALPHA; cells expecting fewer than 5 are pooled into one,
    and a sample the target gives probability 0 fails outright."""
    n, counts = len(samples), Counter(samples)
    if any(expected.get(s, 0.0) <= 0.0 for s in counts):
        return False
    big = [c for c, p in expected.items() if p * n >= 5]
    small = [c for c, p in expected.items() if 0 < p * n < 5]  # (cells of probability 0 hold no sample)
    bins = [([c], expected[c]) for c in big] + ([(small, sum(expected[c] for c in small))] if small else [])
    stat = sum((sum(counts[c] for c in cells) - n * p) ** 2 / (n * p) for cells, p in bins)
    return stat < chi_square_critical(len(bins) - 1)


class ArgmaxRule(RejectionSampler):
    """The negative control: accepts d_i whenever it is p_i's argmax, else draws from p_i."""

    def __call__(self, proposals, q, logits):
        p = self.sampler.probs(logits)
        for i, d in enumerate(proposals):
            if d != int(p[i].argmax()):
                return i, self.sampler.draw(p[i])
        return len(proposals), self.sampler.draw(p[len(proposals)])


# ---- the processing and the seed -------------------------------------------------------------


def test_probabilities_apply_temperature_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.allclose(probabilities(logits, SamplingParams(1.0)), torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    hot = probabilities(logits, SamplingParams(0.5))[0]  # p^2, renormalised
    assert torch.allclose(hot, torch.tensor([16.0, 9.0, 4.0, 1.0]) / 30)
    assert torch.allclose(probabilities(logits, SamplingParams(1.0, top_k=2)), torch.tensor([[4 / 7, 3 / 7, 0, 0]]))
    # top_p 0.7: 0.4 alone is short of it, 0.4 + 0.3 reaches it
    assert torch.allclose(probabilities(logits, SamplingParams(1.0, top_p=0.7)), torch.tensor([[4 / 7, 3 / 7, 0, 0]]))
    assert torch.allclose(probabilities(logits, SamplingParams(1.0, top_p=0.71)),
                          torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0]]))
    # min_p 0.4: below 0.4 * 0.4 = 0.16 goes
    assert torch.allclose(probabilities(logits, SamplingParams(1.0, min_p=0.4)), torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0]]))


def test_draw_is_the_inverse_cdf_of_the_generator_uniforms():
    p = torch.tensor([0.0, 0.25, 0.0, 0.75])
    a, b = Sampler(SamplingParams(1.0), 11), Sampler(SamplingParams(1.0), 11)
    draws = [a.draw(p) for _ in range(400)]
    assert draws == [1 if b.uniform() < 0.25 else 3 for _ in range(400)]
    assert 70 < draws.count(1) < 130


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.5, "temperature is -0.5, expected a finite number >= 0"),
    ("top_k", -1, "top_k is -1, expected a non-negative integer or null"),
    ("top_p", 0.0, r"top_p is 0.0, expected a number in \(0, 1\]"),
    ("min_p", 1.0, r"min_p is 1.0, expected a number in \[0, 1\)"),
    ("seed", -3, "seed is -3, expected a non-negative integer or null"),
])
def test_bad_sampling_fields_are_refused_even_at_temperature_zero(field, value, message):
    fields = dict(temperature=0.0, top_k=None, top_p=1.0, min_p=0.0, seed=None) | {field: value}
    with pytest.raises(turbo.TurboError, match=message):
        rejection_sampler(**fields)


# ---- the rule on synthetic distributions ---------------------------------------------------

V = 6
BIGRAM_P = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(1)) * 1.2, dim=-1)
BIGRAM_Q = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(2)) * 1.5, dim=-1)


class BigramTrunk:
    """A trunk whose next-token distribution after each row is BIGRAM_P[row's token]."""

    def step(self, st, rows, aux_layers, rollback):
        st.pos += len(rows)
        return SimpleNamespace(logits=torch.log(BIGRAM_P[torch.tensor(rows)]))

    def rollback(self, st, out, rows, kept, rollback):
        st.pos -= rows - kept
        return 0


class BigramDrafter(DrafterBase):
    """Chains draws from BIGRAM_Q (q = its rows), or, when `deterministic`, proposes the
    target's greedy continuation (a point mass)."""

    def __init__(self, deterministic: bool):
        self.deterministic = deterministic

    def propose(self, anchor, anchor_pos, block):
        out = [anchor]
        for _ in range(block):
            out.append(int(BIGRAM_P[out[-1]].argmax()))
        return out[1:]

    def propose_sampled(self, anchor, anchor_pos, block, sampler):
        if self.deterministic:
            return self.propose(anchor, anchor_pos, block), None
        pred, out, q = anchor, [], []
        for _ in range(block):
            q.append(BIGRAM_Q[pred])
            pred = sampler.draw(q[-1])
            out.append(pred)
        return out, torch.stack(q)


def first_tokens(rule: RejectionSampler, drafter: DrafterBase, anchor: int, block: int) -> tuple[int, ...]:
    trunk, st, got = BigramTrunk(), SimpleNamespace(pos=0), []
    while len(got) < K:
        r = play_round(trunk, st, drafter, anchor, block, "checkpoint", rule)
        got += r.proposals[:r.accepted] + [r.bonus]
        anchor = r.bonus
    return tuple(got[:K])


def bigram_target(anchor: int) -> dict[tuple[int, ...], float]:
    return {(a, b): float(BIGRAM_P[anchor, a] * BIGRAM_P[a, b]) for a in range(V) for b in range(V)}


@pytest.mark.parametrize("deterministic", [False, True], ids=["q", "point-mass"])
@pytest.mark.parametrize("block", BLOCKS)
def test_the_rule_keeps_the_target_distribution(block, deterministic):
    rule, drafter = RejectionSampler(Sampler(SamplingParams(1.0), 100 + block)), BigramDrafter(deterministic)
    samples = [first_tokens(rule, drafter, 0, block) for _ in range(2500)]
    assert fits(samples, bigram_target(0))


@pytest.mark.parametrize("deterministic", [False, True], ids=["q", "point-mass"])
def test_the_check_rejects_an_argmax_acceptance_rule(deterministic):
    rule, drafter = ArgmaxRule(Sampler(SamplingParams(1.0), 7)), BigramDrafter(deterministic)
    samples = [first_tokens(rule, drafter, 0, 4) for _ in range(2500)]
    assert not fits(samples, bigram_target(0))


# ---- end to end: a random install of a 12-token vocabulary -----------------------------------

VOCAB = 8
PROMPT = [3, 5, 7, 2, 3, 5]  # ends with a repeat, so the n-gram drafter proposes (7, 2, 3, ...)
SAMPLING = dict(temperature=0.8, top_p=0.95, stop_at_eos=False)
CONFIGS = [(b, rb) for b in BLOCKS for rb in ("checkpoint", "replay")]


def word_level_tokenizer(vocab: int):
    """Exactly `vocab` ids (a byte-level BPE needs 256 ids for its alphabet alone)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """A random trunk with a random MTP head, over an 8-token vocabulary: (its directory, config)."""
    from transformers import Qwen3_5ForCausalLM

    tmp = tmp_path_factory.mktemp("small_vocab")
    cfg = hf_config(vocab_size=VOCAB)
    torch.manual_seed(3)
    model = Qwen3_5ForCausalLM(cfg).float().eval()
    randomize_(model, 3)
    model.save_pretrained(tmp / "hf")
    word_level_tokenizer(VOCAB).save(str(tmp / "hf" / "tokenizer.json"))
    (tmp / "hf" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    add_mtp(tmp / "hf", mtp_tensors(cfg, 3, scale=0.3))
    return tmp, cfg


@pytest.fixture(scope="module")
def small(small_checkpoint):
    """The small trunk and MTP head with a random DFlash2 drafter (selector top-k 4)."""
    tmp, cfg = small_checkpoint
    drafter = make_drafter(tmp / "drafter", cfg.hidden_size, VOCAB, [0, cfg.num_hidden_layers - 2], seed=3, top_k=4)
    return turbo.open(repack(tmp / "hf", tmp / "install", drafter=drafter, quiet=True), backend="cpu")


@pytest.fixture(scope="module")
def small_published(small_checkpoint):
    """The small trunk with a random drafter in the published DFlash layout (no selector)."""
    tmp, cfg = small_checkpoint
    drafter = make_published_dflash(tmp / "published", cfg.hidden_size, VOCAB, [0, cfg.num_hidden_layers - 2],
                                    cfg.num_hidden_layers, seed=3)
    return turbo.open(repack(tmp / "hf", tmp / "install_published", drafter=drafter, quiet=True), backend="cpu")


def plain_target(rt) -> dict[tuple[int, ...], float]:
    """The exact distribution of plain sampling's first two tokens, from the trunk's logits."""
    params = SamplingParams(SAMPLING["temperature"], top_p=SAMPLING["top_p"])

    def after(ids):
        return probabilities(rt.trunk.prefill(rt.trunk.new_state(), ids).logits[-1:], params)[0]

    first = after(PROMPT)
    return {(a, b): float(first[a] * pb) for a in range(VOCAB) for b, pb in enumerate(after(PROMPT + [a]))}


def speculative_samples(rt, drafter, n: int, **extra) -> list[tuple[int, ...]]:
    """n generations of K tokens, seeds 0..n-1, going round the (block, rollback) configs."""
    out = []
    for seed in range(n):
        block, rollback = CONFIGS[seed % len(CONFIGS)]
        policy = dict(policy="off") if drafter is None else dict(policy="fixed", block=block, rollback=rollback,
                                                                  drafter=drafter)
        out.append(tuple(rt.generate(PROMPT, max_new_tokens=K, seed=seed, **policy, **SAMPLING, **extra).tokens))
    return out


# strong enough that the second token's distribution depends on the first (turbo/sequence/penalties.py)
PENALISED = dict(repetition_penalty=1.8, frequency_penalty=1.5, presence_penalty=1.0, logit_bias={1: 2.0})


def penalised_target(rt) -> dict[tuple[int, ...], float]:
    """plain_target with the penalties applied at each position, written out plainly
    (tests/test_penalties.py's reference_row)."""
    params = SamplingParams(SAMPLING["temperature"], top_p=SAMPLING["top_p"])
    pen = GenerationOptions(**PENALISED).penalties

    def after(ids, out):
        logits = rt.trunk.prefill(rt.trunk.new_state(), ids).logits[-1]
        return probabilities(reference_row(logits, PROMPT, out, pen)[None], params)[0]

    first = after(PROMPT, [])
    return {(a, b): float(first[a] * pb) for a in range(VOCAB) for b, pb in enumerate(after(PROMPT + [a], [a]))}


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_speculative_sampling_with_penalties_has_the_penalised_distribution(small, kind):
    target = penalised_target(small)
    assert fits(speculative_samples(small, kind, 1000, **PENALISED), target)
    assert not fits(speculative_samples(small, kind, 1000), target)  # (the unpenalised one is not it)


def test_the_check_rejects_rows_penalised_with_the_wrong_state(small, monkeypatch):
    right = PenaltyState.rows
    monkeypatch.setattr(PenaltyState, "rows", lambda self, logits, proposals: right(self, logits, []))
    assert not fits(speculative_samples(small, "dflash", 1000, **PENALISED), penalised_target(small))


@pytest.mark.parametrize("kind", ["off", "mtp", "dflash", "ngram"])
def test_speculative_sampling_matches_plain_sampling(small, kind):
    """Every block of 1, 2, 4, 8 and both rollbacks (pooled: each config samples the target,
    so their mixture does); ngram is a deterministic drafter (a point mass)."""
    drafter = {"off": None, "ngram": NgramDrafter()}.get(kind, kind)
    samples = speculative_samples(small, drafter, 1000)
    assert fits(samples, plain_target(small))


def test_speculative_sampling_with_the_published_dflash_matches_plain_sampling(small_published):
    """Its rows draw from their own processed logits (no selector chains them): q_i = p_draft(row i)."""
    assert small_published.generate(PROMPT, max_new_tokens=2, policy="fixed", block=2).stats.drafter == "dflash"
    assert small_published.drafter("dflash", None).architecture == "DFlashDraftModel"
    assert fits(speculative_samples(small_published, "dflash", 1000), plain_target(small_published))


def test_the_check_rejects_an_argmax_acceptance_rule_end_to_end(small, monkeypatch):
    greedy = small.generate(PROMPT, max_new_tokens=K + 8, policy="off", stop_at_eos=False).tokens
    monkeypatch.setattr(engine, "rejection_sampler", lambda *a: ArgmaxRule(rejection_sampler(*a).sampler))
    assert not fits(speculative_samples(small, ScriptedDrafter(PROMPT + greedy, [8], VOCAB), 400), plain_target(small))


def test_a_seed_repeats_the_generation_and_temperature_zero_is_greedy(small):
    greedy = small.generate(PROMPT, max_new_tokens=20, policy="off", stop_at_eos=False).tokens
    for drafter in ("mtp", "dflash"):
        for block in BLOCKS:
            fixed = dict(max_new_tokens=20, policy="fixed", block=block, drafter=drafter, stop_at_eos=False)
            assert small.generate(PROMPT, temperature=0, top_p=0.5, seed=4, **fixed).tokens == greedy
            a = small.generate(PROMPT, temperature=1.0, seed=4, **fixed)
            assert a.tokens == small.generate(PROMPT, temperature=1.0, seed=4, **fixed).tokens
            assert a.stats.seed == 4 and a.tokens != greedy
    fresh = small.generate(PROMPT, max_new_tokens=4, temperature=1.0, stop_at_eos=False)
    assert fresh.stats.seed is not None and "seed" in fresh.stats.line()


def test_the_probe_samples_and_compares_no_tokens(small, tmp_path):
    from test_probe import probe

    ov = [f"install.path={small.install.path}", "max_new_tokens=8", "probe.prompts_per_workload=2",
          "probe.blocks=[2,4]", "probe.adaptive=false", "drafter=mtp", "temperature=0.7", "top_p=0.9", "seed=0"]
    a, b = probe(tmp_path / "a", ov), probe(tmp_path / "b", ov)
    assert a["lossless"] is None and (a["temperature"], a["top_p"], a["seed"]) == (0.7, 0.9, 0)
    assert all("same_text_as_off" not in r for r in a["runs"])
    counts = ("generated_tokens", "rounds", "drafted", "accepted", "per_position_acceptance")
    assert [{k: r[k] for k in counts} for r in a["runs"]] == [{k: r[k] for k in counts} for r in b["runs"]]
    assert a["runs"][1]["drafted"] == 2 * a["runs"][1]["rounds"]


# a constraint over the 8-token vocabulary, by position: {1, 2, 5}, then {0, 3, 5, 6}, then any but 7; 7 ends it
ALLOWED = ({1, 2, 5}, {0, 3, 5, 6})
CONSTRAINED = dict(response_format={"type": "regex", "regex": "(set by PositionalMatcher)"}, stop_token_ids=[7])


class PositionalMatcher:
    """llguidance's matcher interface (what turbo/grammar.GrammarState calls) over a language
    given by position: ALLOWED[i] at position i, then anything but the stop token 7, which ends it.
    (llguidance cannot read a word-level vocabulary's bytes; the masking under test is turbo's.)"""

    def __init__(self):
        self.tokens: list[int] = []

    def _allowed(self, at: int) -> set[int]:
        return ALLOWED[at] if at < len(ALLOWED) else set(range(VOCAB))

    def compute_bitmask(self) -> bytes:
        mask = np.zeros(32, dtype=bool)
        mask[list(self._allowed(len(self.tokens)))] = True
        return np.packbits(mask, bitorder="little").tobytes()

    def validate_tokens(self, tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) and tokens[n] in self._allowed(len(self.tokens) + n):
            n += 1
        return n

    def consume_token(self, t: int) -> bool:
        ok = t in self._allowed(len(self.tokens))
        self.tokens += [t] if ok else []
        return ok

    def rollback(self, k: int) -> None:
        del self.tokens[len(self.tokens) - k:]

    def is_stopped(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] == 7

    def is_error(self) -> bool:
        return False

    def get_error(self) -> str:
        return ""


def masked_target(rt) -> dict[tuple[int, ...], float]:
    """plain_target with each position's logits masked to what the grammar allows there, before
    temperature and top-p (as turbo/sequence/grammar.py's rows are)."""
    params = SamplingParams(SAMPLING["temperature"], top_p=SAMPLING["top_p"])

    def after(ids, allowed):
        logits = rt.trunk.prefill(rt.trunk.new_state(), ids).logits[-1].clone()
        logits[[t for t in range(VOCAB) if t not in allowed]] = float("-inf")
        return probabilities(logits[None], params)[0]

    first = after(PROMPT, ALLOWED[0])
    return {(a, b): float(first[a] * pb) for a in range(VOCAB) for b, pb in enumerate(after(PROMPT + [a], ALLOWED[1]))}


@pytest.mark.parametrize("kind", ["off", "dflash", "mtp", "ngram"])
def test_speculative_sampling_under_a_grammar_has_the_masked_distribution(small, kind, monkeypatch):
    """Each row masked with the grammar's state after the proposals before it, and the first
    proposal the grammar refused judged (rejected) so its row draws from the residual: speculative
    samples follow the masked distribution (every block of 1, 2, 4, 8 and both rollbacks pooled;
    drawing that row from p instead fails this for dflash and mtp)."""
    monkeypatch.setattr(small.grammars, "state", lambda fmt, stops: GrammarState(PositionalMatcher(), VOCAB))
    drafter = {"off": None, "ngram": NgramDrafter()}.get(kind, kind)
    samples = speculative_samples(small, drafter, 1000, **CONSTRAINED)
    assert all(a in ALLOWED[0] and b in ALLOWED[1] for a, b in samples)
    assert fits(samples, masked_target(small))
    assert not fits(samples, plain_target(small))  # (the unmasked one is not it)


def test_the_check_rejects_rows_masked_with_the_wrong_state(small, monkeypatch):
    """Every row masked with the state before the round: samples leave the masked distribution."""
    monkeypatch.setattr(small.grammars, "state", lambda fmt, stops: GrammarState(PositionalMatcher(), VOCAB))

    def stale(self, logits, proposals):
        return logits.float().masked_fill(~self.allowed(), float("-inf"))

    monkeypatch.setattr(GrammarState, "rows", stale)
    samples = []
    for seed in range(400):  # (a row masked wrongly can accept a token the grammar refuses: found out too)
        try:
            samples.append(tuple(small.generate(PROMPT, max_new_tokens=K, seed=seed, policy="fixed", block=4,
                                                drafter="mtp", **SAMPLING, **CONSTRAINED).tokens))
        except (TurboError, IndexError):
            samples.append((-1, -1))
    assert not fits(samples, masked_target(small))

"""The n-gram drafter: its matching rules, its incremental index against a scan, its config
checks, and losslessness through the engine's verify."""

import dataclasses
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

import turbo
from turbo.config import run_config
from turbo.drafters import is_drafter
from turbo.drafters.ngram import NgramConfig, NgramDrafter
from turbo.errors import TurboError
from turbo.sequence.policy import (DEFAULT_SPECULATION_BLOCK, DFLASH_BLOCK, MOE_SPECULATION_BLOCKER_MARKER,
    VISION_SPECULATION_BLOCKER_MARKER, Plan, plan)
from turbo.store.install import open_install

ROOT = Path(__file__).parents[1]


def drafter(prompt: list[int], **config) -> NgramDrafter:
    d = NgramDrafter(NgramConfig(**config))
    d.begin(None, prompt)
    return d


def propose(d: NgramDrafter, block: int = 8) -> list[int]:
    return d.propose(d.history[-1], len(d.history) - 1, block)


def step_out(tokens: list[int], vocab: int = 50) -> SimpleNamespace:
    """A StepOut whose greedy token after row j is tokens[j]."""
    return SimpleNamespace(logits=torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float())


def scan(history: list[int], prompt_len: int, config: NgramConfig, block: int) -> list[int]:
    """The drafter's rule by brute force: the longest suffix with an earlier occurrence whose
    continuation starts where `search` looks, its latest one, copied on past the end."""
    size = len(history)
    lo = prompt_len if config.search == "generated" else 1
    hi = prompt_len if config.search == "prompt" else size
    for n in range(min(config.max_match, size), config.min_match - 1, -1):
        for e in range(min(hi, size) - 1, max(lo, n) - 1, -1):
            if history[e - n:e] == history[size - n:]:
                s = list(history)
                for i in range(min(block, config.max_proposal)):
                    s.append(s[e + i])
                return s[size:]
    return []


# ---- matching ---------------------------------------------------------------------------

def test_the_longest_match_wins():
    # the suffix [7, 1, 2]: a 2-gram match (1, 2) follows with 8 at the end, the 3-gram with 9
    d = drafter([7, 1, 2, 9, 9, 3, 1, 2, 8, 8, 7, 1, 2], max_match=3)
    assert propose(d, 2) == [9, 9]
    assert propose(drafter(d.history, max_match=2), 2) == [8, 8]


def test_the_most_recent_occurrence_wins():
    d = drafter([1, 2, 5, 0, 1, 2, 6, 0, 1, 2])
    assert propose(d, 1) == [6]


def test_min_match_is_respected():
    prompt = [4, 9, 1, 3, 5, 1]  # only the last token occurred before
    assert propose(drafter(prompt, min_match=2)) == []
    assert propose(drafter(prompt, min_match=1), 3) == [3, 5, 1]


def test_block_and_max_proposal_cap_the_proposal():
    prompt = list(range(20)) + [0, 1]
    assert propose(drafter(prompt), 3) == [2, 3, 4]
    assert propose(drafter(prompt, max_proposal=5), 8) == [2, 3, 4, 5, 6]


def test_a_loop_is_copied_past_the_anchor():
    assert propose(drafter([3, 4, 3, 4]), 5) == [3, 4, 3, 4, 3]


@pytest.mark.parametrize("search, expected", [("all", [6]), ("prompt", [5]), ("generated", [6])])
def test_search_picks_where_the_continuation_comes_from(search, expected):
    d = drafter([1, 2, 5], search=search)
    d.extend([1, 2, 6, 1, 2])
    assert propose(d, 1) == expected


def test_generated_search_ignores_the_prompt():
    d = drafter([1, 2, 5, 1, 2], search="generated")
    assert propose(d) == []


@pytest.mark.parametrize("config", [NgramConfig(), NgramConfig(min_match=1, max_match=3, max_proposal=5),
                                    NgramConfig(search="prompt"), NgramConfig(min_match=1, search="generated")])
def test_the_incremental_index_equals_a_scan(config):
    rng = random.Random(7)
    for _ in range(20):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        d = NgramDrafter(config)
        d.begin(None, prompt)
        for _ in range(30):
            block = rng.randrange(1, 9)
            assert propose(d, block) == scan(d.history, len(prompt), config, block)
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 5))]
            if rng.random() < 0.5:
                d.commit(step_out(tokens), len(tokens), tokens)
            else:
                d.commit_deferred([d.defer(step_out(tokens + [0]), len(tokens), tokens)])


def test_commit_appends_the_committed_tokens_of_the_kept_rows():
    d = drafter([1, 2, 3])
    d.commit(step_out([4, 5, 6, 7]), 2, [4, 5])
    assert d.history == [1, 2, 3, 4, 5]
    assert d.defer(step_out([8, 9]), 1, [8]) == [8]


def test_an_anchor_off_the_history_is_an_engine_bug():
    d = drafter([1, 2, 3])
    with pytest.raises(ValueError, match="the anchor is 3 at 3"):
        d.propose(3, 3, 4)
    with pytest.raises(ValueError, match="the anchor is 2 at 2"):
        d.propose(2, 2, 4)


def test_it_honours_the_drafter_protocol():
    d = NgramDrafter()
    assert is_drafter(d) and (d.kind, d.aux_layers, d.window) == ("ngram", (), None)


@pytest.mark.parametrize("fields, message", [
    (dict(min_match=0), "ngram min_match is 0, expected a positive integer"),
    (dict(max_match=True), "ngram max_match is True, expected a positive integer"),
    (dict(max_proposal=2.0), "ngram max_proposal is 2.0, expected a positive integer"),
    (dict(min_match=3, max_match=2), "ngram max_match 2 is below min_match 3, expected max_match >= min_match"),
    (dict(search="both"), "ngram search 'both' is not one of all, prompt, generated"),
])
def test_config_refusals_name_the_field(fields, message):
    with pytest.raises(TurboError) as e:
        NgramConfig(**fields)
    assert str(e.value) == message


# ---- through the engine -----------------------------------------------------------------

def generate_with(rt, prompt, drafter: NgramDrafter, policy: str, block: int, **kwargs):
    return rt.generate(prompt, policy=policy, block=block, drafter=drafter, **kwargs)


REPEATING = [int(t) for t in torch.randint(2, 320, (24,), generator=torch.Generator().manual_seed(5))] * 3


@pytest.mark.parametrize("install", ["spec_install", "plain_install"])
@pytest.mark.parametrize("by_name", [False, True], ids=["object", "drafter=ngram"])
def test_lossless_on_every_block_and_rollback(install, by_name, step_path, request):
    # 72 prompt tokens + 40: past the spec install drafter's window (64), which ngram does not keep
    rt = turbo.open(request.getfixturevalue(install)[1], backend="cpu")
    assert rt.trunk.step_name == step_path

    def fresh():
        return "ngram" if by_name else NgramDrafter()

    plain = rt.generate(REPEATING, max_new_tokens=40, policy="off").tokens
    for rollback in ("checkpoint", "replay"):
        for block in range(1, 9):
            out = generate_with(rt, REPEATING, fresh(), "fixed", block, max_new_tokens=40, rollback=rollback)
            assert out.tokens == plain, (rollback, block)
            assert out.stats.drafted > 0  # the repeated prompt is matched: proposals reach the verify
            assert out.stats.drafter == "ngram"
    assert generate_with(rt, REPEATING, fresh(), "adaptive", 8, max_new_tokens=40).tokens == plain


def test_proposals_land_on_the_tiny_model():
    # a random trunk never repeats itself; the trained one falls into loops the drafter copies
    rt = turbo.open("tiny", backend="cpu")
    workload = OmegaConf.load(ROOT / "conf" / "workload" / "edit.yaml")
    prompt, n = workload.prompts[0], workload.max_new_tokens
    plain = rt.generate(prompt, max_new_tokens=n, policy="off").tokens
    out = generate_with(rt, prompt, NgramDrafter(), "fixed", 4, max_new_tokens=n)
    assert out.tokens == plain
    assert out.stats.accepted_per_round > 0.5


# ---- drafter=ngram: the policy, the options, the config -----------------------------------

CPU = (1, 2, 3)


def test_ngram_needs_no_drafter_weights_and_auto_never_picks_it(plain_install):
    bare = open_install(plain_install[1])
    assert plan(bare, "auto", None, "auto", CPU).drafter is None
    assert plan(bare, "auto", None, "ngram", CPU) == Plan("auto", "ngram", DEFAULT_SPECULATION_BLOCK, None)
    assert plan(bare, "adaptive", None, "ngram", CPU).block == DFLASH_BLOCK
    assert plan(bare, "fixed", 8, "ngram", CPU).block == 8
    with pytest.raises(TurboError, match="block 9 is outside 1..8"):
        plan(bare, "fixed", 9, "ngram", CPU)


def test_the_verify_blockers_still_apply_to_ngram(plain_install, tmp_path):
    bare = open_install(plain_install[1])
    moe = dataclasses.replace(bare, arch=dataclasses.replace(bare.arch, num_experts=64))
    assert plan(moe, "auto", None, "ngram", CPU).off_reason.startswith(MOE_SPECULATION_BLOCKER_MARKER)
    with pytest.raises(TurboError, match=r"speculation blocked \[moe\]"):
        plan(moe, "fixed", 2, "ngram", CPU)
    assert "is dtype 3" in plan(bare, "auto", None, "ngram", (4, 15, 16)).off_reason
    dst = tmp_path / "vis"
    shutil.copytree(plain_install[1], dst)
    save_file({"vision.patch_embed.proj.weight": torch.zeros(4, 3)}, str(dst / "vision.safetensors"))
    reason = plan(open_install(dst), "adaptive", None, "ngram", CPU).off_reason
    assert reason.startswith(VISION_SPECULATION_BLOCKER_MARKER)


@pytest.fixture(scope="module")
def plain_rt(plain_install):
    return turbo.open(plain_install[1], backend="cpu")


def test_the_generation_options_configure_the_drafter(plain_rt):
    plain = plain_rt.generate(REPEATING, max_new_tokens=24, policy="off").tokens
    one = plain_rt.generate(REPEATING, max_new_tokens=24, policy="fixed", block=4, drafter="ngram",
                            ngram=NgramConfig(max_proposal=1))
    assert one.tokens == plain and 0 < one.stats.drafted <= one.stats.rounds
    # search=generated: the repeated prompt is not looked at, and this random trunk does not repeat itself
    out = plain_rt.generate(REPEATING, max_new_tokens=24, policy="fixed", block=4, drafter="ngram",
                            ngram=NgramConfig(search="generated"))
    assert out.tokens == plain and out.stats.drafted < one.stats.drafted


def test_window_and_a_bad_ngram_option_are_refused(plain_rt):
    with pytest.raises(TurboError, match="window 8: .* the n-gram drafter looks through the whole history"):
        plain_rt.generate([5, 6, 7], max_new_tokens=4, drafter="ngram", window=8)
    with pytest.raises(TurboError, match="ngram {'min_match': 3} is not a turbo.drafters.ngram.NgramConfig"):
        plain_rt.generate([5, 6, 7], max_new_tokens=4, drafter="ngram", ngram={"min_match": 3})


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


def test_the_config_block_reaches_the_options_and_the_tui():
    from tui import compose_settings

    g = run_config(compose(["drafter=ngram", "ngram.min_match=3", "ngram.search=prompt"])).generation
    assert (g.drafter, g.ngram) == ("ngram", NgramConfig(min_match=3, search="prompt"))
    assert run_config(compose([])).generation.ngram == NgramConfig()
    s = compose_settings(["drafter=ngram", "ngram.max_proposal=4"])
    assert (s.generation.drafter, s.generation.ngram.max_proposal) == ("ngram", 4)


@pytest.mark.parametrize("override, message", [
    ("+ngram.longest=3", "config: ngram.longest is not one of min_match, max_match, max_proposal, search"),
    ("ngram.max_match=1", "ngram max_match 1 is below min_match 2, expected max_match >= min_match"),
    ("ngram=4", "config: ngram=4, expected a mapping of min_match, max_match, max_proposal, search"),
])
def test_config_refusals_name_the_key(override, message):
    with pytest.raises(TurboError) as e:
        run_config(compose([override]))
    assert str(e.value) == message

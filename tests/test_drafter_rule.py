"""One rule for a drafter that is not there, for every drafter (auto, dflash, mtp, ngram, a caller's
object) and policy (auto, off, fixed, adaptive), on an install without a drafter of its own: policy
auto with drafter auto decodes plainly and says why and what works (drafter=ngram); a named drafter
the install lacks, or fixed / adaptive with none, refuses in one line naming it and what works
here (exit 2 on the CLI); ngram and a caller's object need no weights and speculate."""

from __future__ import annotations

import subprocess
import sys

import pytest

import turbo
from turbo.errors import TurboError
from turbo.testing import ScriptedDrafter

DRAFTERS = ["auto", "dflash", "mtp", "ngram", "object"]
POLICIES = ["auto", "off", "fixed", "adaptive"]
MISSING = {"auto": "this install carries no DFlash2 drafter", "dflash": "this install carries no DFlash2 drafter",
           "mtp": "this install carries no MTP head"}
PROMPT = [5, 6, 7, 8, 5, 6, 7]


@pytest.fixture(scope="module")
def bare(plain_install):
    return turbo.open(plain_install[1], backend="cpu")


def generate(rt, drafter: str, policy: str):
    plain = rt.generate(PROMPT, max_new_tokens=6, policy="off", stop_at_eos=False).tokens
    own = ScriptedDrafter(PROMPT + plain, [1], rt.install.arch.vocab) if drafter == "object" else drafter
    return rt.generate(PROMPT, max_new_tokens=6, policy=policy, block=2 if policy == "fixed" else None,
                       drafter=own, stop_at_eos=False), plain


def outcome(drafter: str, policy: str) -> str:
    """The rule, written out: plain | speculate | refuse."""
    if policy == "off":
        return "plain"
    if drafter in ("ngram", "object"):
        return "speculate"
    return "plain" if (drafter, policy) == ("auto", "auto") else "refuse"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_drafter_and_policy_on_an_install_without_a_drafter(bare, drafter, policy):
    want = outcome(drafter, policy)
    if want == "refuse":
        with pytest.raises(TurboError) as e:
            generate(bare, drafter, policy)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(MISSING[drafter])
        assert msg.endswith("; what works on this install: drafter=ngram, +policy=off")
        return
    res, plain = generate(bare, drafter, policy)
    assert res.tokens == plain  # every outcome is lossless
    if want == "plain":
        assert res.stats.drafter is None and res.stats.rounds == len(plain) and res.stats.accepted == 0
        if policy == "auto":  # says why, and what would speculate here
            reason = res.stats.speculation_off_reason
            assert reason.startswith(MISSING[drafter]) and reason.endswith("; what works on this install: drafter=ngram")
    else:
        assert res.stats.drafter == ("dflash" if drafter == "object" else "ngram")  # the object's kind
        assert res.stats.speculation_off_reason is None and res.stats.drafted > 0


def test_the_alternatives_are_this_installs(spec_install):
    rt = turbo.open(spec_install[1], backend="cpu")  # a DFlash2 drafter, no MTP head
    for policy in ("auto", "fixed", "adaptive"):
        with pytest.raises(TurboError, match=r"^this install carries no MTP head .*; what works on this install: "
                                             r"drafter=dflash, drafter=ngram, \+policy=off$"):
            rt.plan(policy, 2 if policy == "fixed" else None, "mtp")
    assert rt.plan("auto", None, "auto").drafter == "dflash"


def cli(tmp_path, install, *overrides):
    cmd = [sys.executable, "-m", "turbo", f"hydra.run.dir={tmp_path}/hydra", "threads=1", "backend=cpu",
           f"install.path={install}", "prompt=hi", "max_new_tokens=4", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_the_cli_refuses_a_named_drafter_in_one_line_and_auto_says_what_works(plain_install, tmp_path):
    refused = cli(tmp_path, plain_install[1], "drafter=mtp")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert lines[0].startswith("error: this install carries no MTP head") and "drafter=ngram" in lines[0]
    fallback = cli(tmp_path, plain_install[1])
    assert fallback.returncode == 0, fallback.stderr
    assert "speculation off: this install carries no DFlash2 drafter" in fallback.stderr
    assert "what works on this install: drafter=ngram" in fallback.stderr

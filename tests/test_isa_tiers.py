"""TURBO_ISA: the native library built for one x86 tier (avx2, avx512, amx). The losslessness and
golden tests run again, in a process of their own, at every tier this CPU runs below its best (the
rest of the suite runs at the best): each tier's products are the same chains, so the goldens hold
at every one (AMX's bf16-rounded products aside: tiny is fp32, which AMX leaves to the fp32 walk)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from turbo.backends import native_build

ROOT = Path(__file__).resolve().parent.parent

# the tests that say a tier computes what the others do: the goldens (greedy and speculative),
# verify rows = decode steps bit for bit, batches = solo steps, the int4 / int8 products, the
# drafters' products
EQUALITY_TESTS = ["tests/test_tiny.py", "tests/test_native_prefill.py", "tests/test_step_many.py",
                  "tests/test_speculative.py", "tests/test_quant.py", "tests/test_draft_products.py",
                  "tests/test_native_dflash.py"]

FLAGS = native_build.cpu_flags()
BEST = native_build.best_tier(FLAGS)
BELOW = [t for t in native_build.TIERS if t != BEST and native_build.TIERS[t][1] <= FLAGS]


def run_turbo(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "turbo", "max_new_tokens=2"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **env}, timeout=600)


def test_an_unknown_tier_is_refused_in_one_line():
    done = run_turbo({native_build.ISA_ENV: "avx9"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: TURBO_ISA='avx9': expected one of avx2, avx512, amx (or unset: the best this CPU has)"]


@pytest.mark.skipif(set(native_build.TIERS) <= {BEST, *BELOW}, reason="this CPU runs every tier")
def test_a_tier_this_cpu_lacks_is_refused_in_one_line():
    missing = next(t for t in native_build.TIERS if not native_build.TIERS[t][1] <= FLAGS)
    done = run_turbo({native_build.ISA_ENV: missing})
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: TURBO_ISA={missing}: this CPU lacks ")


def test_the_tier_is_part_of_the_librarys_key():
    cc = "cc"
    keys = {native_build._key(cc, tier) for tier in (None, *native_build.TIERS)}
    assert len(keys) == len(native_build.TIERS) + 1


def test_the_best_tier_is_the_default(monkeypatch):
    monkeypatch.delenv(native_build.ISA_ENV, raising=False)
    assert native_build.isa_tier() == BEST
    assert native_build.best_tier(frozenset({"avx2", "fma", "f16c"})) == "avx2"
    assert native_build.best_tier(frozenset({"sse4_2"})) is None


@pytest.mark.skipif(not BELOW, reason="no tier below this CPU's best (not x86, or AVX2 is its best)")
@pytest.mark.parametrize("tier", BELOW)
def test_the_equality_tests_pass_at_every_tier_below_the_best(tier):
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *EQUALITY_TESTS],
                          capture_output=True, text=True, cwd=ROOT, timeout=1200,
                          env={**os.environ, native_build.ISA_ENV: tier})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]

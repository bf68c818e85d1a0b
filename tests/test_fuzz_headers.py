"""Seeded header fuzz of a small install: every case a clean TurboError or an unchanged generation."""

import time
from pathlib import Path

from scripts import fuzz

CASES_PER_CLASS = 6


def test_header_mutations_end_cleanly(spec_install):
    base = Path(spec_install[1]).resolve()
    cases = fuzz.header_cases(base, CASES_PER_CLASS * len(fuzz.HEADER_MUTATORS), seed=1234)
    start = time.monotonic()
    outcomes = fuzz.run_cases(base, cases, timeout=60)
    elapsed = time.monotonic() - start
    bad = [(o.case.cls, o.case.file, o.outcome, o.detail[:120]) for o in outcomes if o.outcome in fuzz.BAD]
    assert not bad, fuzz.table(outcomes) + "\n" + "\n".join(map(str, bad))
    for o in outcomes:
        # turbo's header reader accepts exactly what the library accepts (stricter only on a name given twice)
        if o.case.cls in fuzz.STRICTER_THAN_LIBRARY and o.library_ok:
            assert not o.turbo_header_ok, o.case.cls
        else:
            assert o.turbo_header_ok == o.library_ok, (o.case.cls, o.case.file, o.detail)
        if o.case.cls.startswith("noop-"):
            assert o.outcome == "generated-equal", (o.case.cls, o.detail)
    # an unreadable open layout (packed.safetensors, derived from the weights) is left aside, said
    assert {o.outcome for o in outcomes} == {"turbo_error", "generated-equal", "layout-ignored"}
    assert all(o.case.file == "packed.safetensors" for o in outcomes if o.outcome == "layout-ignored")
    assert elapsed < 120, elapsed

"""Seeded config fuzz of a small install: every case a clean TurboError, an unchanged generation,
or (a valid trunk value that changes the model) another generation; never an accepted nonsense value."""

import time
from pathlib import Path

from scripts import fuzz

CASES_PER_CLASS = 3  # per file: the whole run stays within ~30 s


def test_config_mutations_end_cleanly(spec_install):
    base = Path(spec_install[1]).resolve()
    cases = fuzz.config_cases(base, CASES_PER_CLASS * 2 * len(fuzz.CONFIG_CLASSES), seed=4321)
    assert {c.file for c in cases} == {"config.json", "dflash/config.json"}
    start = time.monotonic()
    outcomes = fuzz.run_cases(base, cases, timeout=60)
    elapsed = time.monotonic() - start
    bad = [(o.case.cls, o.outcome, o.detail[:160]) for o in outcomes if o.outcome in fuzz.BAD]
    assert not bad, fuzz.table(outcomes) + "\n" + "\n".join(map(str, bad))
    for o in outcomes:
        cls = o.case.cls.split(":")[1]
        if cls in ("noop",) or o.case.cls == "dflash:semantic":  # the speculation is lossless
            assert o.outcome == "generated-equal", (o.case.cls, o.detail)
        if o.case.must_refuse:
            assert o.outcome == "turbo_error" and "\n" not in o.detail, (o.case.cls, o.detail)
    assert {o.outcome for o in outcomes} >= {"turbo_error", "generated-equal"}
    assert elapsed < 60, elapsed

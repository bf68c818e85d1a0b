"""scripts/fuzz.py's drafter-object and config-field classes, a few dozen cases of each, run in
this process through the worker's own handler and judged by its classify (the script runs them
in a worker subprocess, thousands at a time: docs/hardening.md)."""

import json
import shutil
from pathlib import Path

import turbo
from scripts import fuzz

classes = fuzz.fuzz_classes

OK = {"turbo_error", "generated-equal", "generated-sampled", "matches-reference"}


def judged(cases, reply) -> list:
    outcomes = [fuzz.classify(c, reply(c), []) for c in cases]
    bad = [(o.case.cls, o.outcome, o.detail[:160]) for o in outcomes if o.outcome not in OK]
    assert not bad, "\n".join(map(str, bad))
    return outcomes


def test_drafter_objects_are_refused_in_one_line_or_change_nothing():
    base = str(Path(turbo.__file__).parent / "installs" / "tiny")
    runtimes: dict = {}
    cases = fuzz.drafter_cases(Path(base), 2 * len(classes.DRAFTER_CLASSES), seed=5)
    outcomes = judged(cases, lambda c: fuzz.class_reply(c.job | {"install": base}, runtimes))
    by_class = {o.case.cls: o.outcome for o in outcomes}
    assert by_class["drafter:valid"] == by_class["drafter:reenter-caught"] == "generated-equal"
    assert by_class["drafter:q-valid"] == "generated-sampled"
    assert by_class["drafter:raise-in-begin"] == by_class["drafter:q-nan"] == "turbo_error"


def test_config_fields_are_refused_or_match_transformers(tmp_path):
    hf_dir, install = classes.field_base(tmp_path)
    cases = fuzz.field_cases(hf_dir, install, 35, seed=5)
    case_dir = tmp_path / "case"

    def reply(c):
        shutil.rmtree(case_dir, ignore_errors=True)
        shutil.copytree(install, case_dir)
        (case_dir / "config.json").write_bytes(c.blob)
        return fuzz.class_reply(c.job | {"install": str(case_dir)}, {})

    outcomes = judged(cases, reply)
    assert {o.outcome for o in outcomes} == {"turbo_error", "matches-reference"}
    rope = [json.loads(c.blob).get("rope_parameters", {}).get("rope_type") for c in cases]
    assert "yarn" in rope and "linear" in rope

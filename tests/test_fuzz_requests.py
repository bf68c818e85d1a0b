"""scripts/fuzz.py's request-shaped classes (scripts/fuzz_requests.py): schemas, grammars, regexes,
tools and tool results, here at their smallest sizes, one case of each class posted in the worker
subprocess: each is served or a 4xx with OpenAI's error object, and the unmutated requests keep
their text (the full runs, at depth and size, with their crash counts: docs/hardening.md)."""

import json
import random

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from scripts import fuzz  # noqa: E402 (after the skips)

requests = fuzz.fuzz_requests

OK = {"error-4xx", "served"}


@pytest.fixture
def smallest(monkeypatch):
    """Every class at its smallest depth, count and length (the deep ones wait for the bounds)."""
    monkeypatch.setattr(requests, "DEPTHS", requests.DEPTHS[:1])
    monkeypatch.setattr(requests, "COUNTS", requests.COUNTS[:1])
    monkeypatch.setattr(requests, "LENGTHS", requests.LENGTHS[:2])


def test_every_class_makes_a_request_body_at_every_size():
    rng = random.Random(0)
    for cls in requests.CLASSES:
        bodies = [requests.request_case(cls, rng) for _ in range(8)]
        for route, template, body in bodies:
            assert route.startswith("/v1/") and template in ("own", "xml")
            try:
                parsed = json.loads(body)
            except RecursionError:  # (nested past Python's parser: what the server's own parser bounds)
                continue
            assert parsed["model"] == "tiny" and ("prompt" in parsed or "messages" in parsed)
    deep = requests.schema_ref_chain(random.Random(1))
    assert deep.count('"$ref"') >= min(requests.COUNTS)


def test_each_class_is_served_or_refused_and_the_server_keeps_serving(smallest):
    out = fuzz.run_requests(len(requests.CLASSES), seed=5)
    assert not [(o.case.cls, o.outcome, o.detail) for o in out if o.outcome not in OK]
    assert {o.case.cls for o in out} == set(requests.CLASSES)

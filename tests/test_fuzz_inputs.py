"""scripts/fuzz.py's input classes (scripts/fuzz_inputs.py), a seeded sample of each: malformed
server request bodies are each a 4xx with OpenAI's error object and the server keeps giving the
unmutated request's text; mutated GGUF tensor tables are each refused in one line, no-op ones
repack to the same bytes (the full runs: docs/hardening.md)."""


import pytest

pytest.importorskip("fastapi")
pytest.importorskip("gguf")

from scripts import fuzz_inputs  # noqa: E402 (after the skips: it needs fastapi and gguf)

OK = {"error-4xx", "served", "served-equal", "turbo_error", "repacked-equal"}


def test_malformed_bodies_are_4xx_and_the_server_keeps_serving():
    out = fuzz_inputs.run_bodies(3 * len(fuzz_inputs.BODY_CLASSES), seed=3)
    assert not [o for o in out if o[1] not in OK], [o for o in out if o[1] not in OK]
    by = {cls: {o for c, o, _ in out if c == cls} for cls in fuzz_inputs.BODY_CLASSES}
    assert all(by[c] == {"error-4xx"} for c in fuzz_inputs.REFUSE_BODY)
    assert all(by[c] == {"served-equal"} for c in fuzz_inputs.NOOP_BODY)


def test_mutated_gguf_tables_are_refused_and_noops_repack_the_same():
    out = fuzz_inputs.run_gguf(2 * len(fuzz_inputs.GGUF_CLASSES), seed=3)
    assert not [o for o in out if o[1] not in OK], [o for o in out if o[1] not in OK]
    assert {o for c, o, _ in out if c in fuzz_inputs.GGUF_REFUSE} == {"turbo_error"}
    assert {o for c, o, _ in out if c in fuzz_inputs.GGUF_NOOP} == {"repacked-equal"}

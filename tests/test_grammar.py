"""Constrained output (turbo/sequence/grammar.py): a JSON object, a JSON schema, a regex and a Lark grammar
hold at every committed position, so speculation (every drafter, blocks 1..8, both rollbacks)
commits the unspeculated constrained output token for token; every answer of a seeded batch
through the server parses and validates; bad constraints are refused naming the field."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from test_train_example import qwen35_install  # noqa: E402,F401  (a random trunk over the real vocabulary)

import turbo  # noqa: E402
from turbo.drafters.ngram import NgramDrafter  # noqa: E402
from turbo.errors import TurboError  # noqa: E402
from turbo.sequence.grammar import GrammarState  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
FORMATS = {"json_schema": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
           "json_object": {"type": "json_object"},
           "regex": {"type": "regex", "regex": r"[0-9]{2,4}-[a-z]{1,8}( [a-z]{1,8}){0,3}"},
           "grammar": {"type": "grammar", "grammar": 'start: "x = " num ("+" num)? ("+" num)?\nnum: /[0-9]{1,3}/\n'}}
# blocks 1..8, every drafter (the install's DFlash2 and MTP head, the n-gram matcher, a caller's own
# object), both rollbacks
SPECULATION = [dict(policy="fixed", block=b, drafter=d, rollback=rb)
               for b, d, rb in [(1, "dflash", "replay"), (2, "mtp", "replay"), (3, "mtp", "checkpoint"),
                                (4, "dflash", "checkpoint"), (5, "ngram", "replay"), (6, "dflash", "replay"),
                                (7, NgramDrafter(), "checkpoint"), (8, "ngram", "checkpoint"), (8, "mtp", "replay")]]
PROMPT = "def fib(n):"


def holds(kind: str, text: str) -> bool:
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if kind == "json_object":
            return isinstance(value, dict)
        jsonschema.validate(value, SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(FORMATS["regex"]["regex"], text) is not None
    return re.fullmatch(r"x = [0-9]{1,3}(\+[0-9]{1,3}){0,2}", text) is not None


@pytest.fixture(scope="module")
def tiny():
    return turbo.open("tiny", threads=1)


@pytest.mark.parametrize("kind", FORMATS)
def test_speculation_commits_the_unspeculated_constrained_output(tiny, kind):
    plain = tiny.generate(PROMPT, max_new_tokens=48, policy="off", response_format=FORMATS[kind])
    assert plain.finish.reason == "stop" and holds(kind, plain.text), plain.text
    drafted = 0
    for spec in SPECULATION:
        res = tiny.generate(PROMPT, max_new_tokens=48, response_format=FORMATS[kind], **spec)
        assert res.tokens == plain.tokens, spec
        drafted += res.stats.accepted
    # proposals landed inside the schema (the rows after them were masked too); tiny's code-like
    # proposals rarely fit the other formats: there the grammar cut them before the verify
    assert drafted > 0 or kind != "json_schema"


def test_rows_masked_with_the_wrong_state_break_the_equality(tiny, monkeypatch):
    """The negative control: every row masked with the grammar's state before the round (not
    after the proposals before it) commits other tokens than plain decoding somewhere."""
    fmt = FORMATS["json_schema"]
    plain = tiny.generate(PROMPT, max_new_tokens=48, policy="off", response_format=fmt).tokens
    right = GrammarState.rows

    def stale(self, logits, proposals):
        out = logits.float().clone()
        out.masked_fill_(~self.allowed(), float("-inf"))
        return out

    def tokens(spec):
        try:
            return tiny.generate(PROMPT, max_new_tokens=48, response_format=fmt, **spec).tokens
        except TurboError:  # (the grammar refused a committed token: found out too)
            return None

    monkeypatch.setattr(GrammarState, "rows", stale)
    assert any(tokens(spec) != plain for spec in SPECULATION if spec["block"] > 1)
    monkeypatch.setattr(GrammarState, "rows", right)
    assert all(tokens(spec) == plain for spec in SPECULATION)


def test_sampled_answers_hold_and_repeat_by_seed(tiny):
    for seed in range(6):
        a = tiny.generate(PROMPT, max_new_tokens=64, temperature=0.9, seed=seed, response_format=FORMATS["json_schema"],
                          policy="fixed", block=4)
        assert a.finish.reason == "stop" and holds("json_schema", a.text), a.text
        b = tiny.generate(PROMPT, max_new_tokens=64, temperature=0.9, seed=seed, response_format=FORMATS["json_schema"],
                          policy="fixed", block=4)
        assert b.tokens == a.tokens


@pytest.mark.parametrize("fmt, says", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}}, "response_format (json_schema)"),
    ({"type": "regex", "regex": "([a-z"}, "response_format (regex)"),
    ({"type": "grammar", "grammar": "start: missing_rule\n"}, "response_format (grammar)"),
    ({"type": "yaml"}, "response_format is"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 3}}},
     "Unsatisfiable schema"),
    ({"type": "regex", "regex": r"a[^\s\S]b"}, "no output satisfies it"),
])
def test_bad_constraints_are_refused_naming_the_field(tiny, fmt, says):
    with pytest.raises(TurboError) as e:
        tiny.generate(PROMPT, max_new_tokens=4, response_format=fmt)
    assert says in str(e.value) and e.value.field == "response_format" and "\n" not in str(e.value)


def test_a_grammar_whose_strings_never_end_stops_in_one_line(tiny, tiny_server):
    """`a: "x" a` has no finite string: its parser gives up mid-generation. Python: a TurboError
    naming response_format; the server: a 400 for that request, the next served."""
    endless = {"type": "grammar", "grammar": 'start: a\na: "x" a\n'}
    with pytest.raises(TurboError) as e:
        tiny.generate(PROMPT, max_new_tokens=64, response_format=endless)
    assert e.value.field == "response_format" and "\n" not in str(e.value)
    engine, http = tiny_server.engine, tiny_server.http
    resp = http.post("/v1/completions", json={"model": engine.model, "prompt": PROMPT, "max_tokens": 64,
                                              "response_format": endless})
    assert resp.status_code in (200, 400), resp.text  # (a 200 stream's error event, or a 400 before any token)
    if resp.status_code == 400:
        assert resp.json()["error"]["param"] == "response_format"
    assert http.post("/v1/completions", json={"model": engine.model, "prompt": PROMPT, "max_tokens": 4}).status_code == 200


def test_a_constraint_without_a_stop_token_is_refused(tiny):
    with pytest.raises(TurboError, match="ends at a stop token"):
        tiny.generate(PROMPT, max_new_tokens=4, stop_at_eos=False, response_format=FORMATS["json_object"])


def test_the_command_line_takes_a_constraint(tiny, tmp_path):
    def run(*overrides):
        return subprocess.run([sys.executable, "-m", "turbo", "threads=1", "max_new_tokens=40", "prompt=Say:",
                               *overrides], capture_output=True, text=True, cwd=tmp_path, timeout=300)

    ok = run("+response_format={type: regex, regex: '[0-9]{3}-[a-z]{2,5}'}")
    assert ok.returncode == 0, ok.stderr
    want = tiny.generate("Say:", max_new_tokens=40, response_format={"type": "regex", "regex": "[0-9]{3}-[a-z]{2,5}"})
    assert ok.stdout == want.text and re.fullmatch("[0-9]{3}-[a-z]{2,5}", want.text)  # (stdout: the text alone)
    bad = run("+response_format={type: regex, regex: '(['}")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "response_format (regex)" in bad.stderr


def test_the_server_holds_every_answer_of_a_seeded_batch(tiny, tiny_server):
    engine, http, client = tiny_server.engine, tiny_server.http, tiny_server.client
    ask = [{"role": "user", "content": "Describe a fib function as JSON."}]

    def chat(seed: int):
        return client.chat.completions.create(model=engine.model, messages=ask, max_tokens=400, seed=seed,
                                              temperature=0.8, response_format=FORMATS["json_schema"],
                                              extra_body={"turbo": {"policy": "fixed", "block": 4}})

    with ThreadPoolExecutor(8) as pool:  # concurrent: the scheduler batches them
        answers = list(pool.map(chat, range(8)))
    for a in answers:
        assert a.choices[0].finish_reason == "stop" and holds("json_schema", a.choices[0].message.content)
    for kind in ("regex", "grammar"):
        r = client.completions.create(model=engine.model, prompt=PROMPT, max_tokens=48, temperature=0,
                                      extra_body={"turbo": {kind: FORMATS[kind][kind]}})
        assert holds(kind, r.choices[0].text), r.choices[0].text
        assert r.choices[0].text == tiny.generate(PROMPT, max_new_tokens=48, response_format=FORMATS[kind]).text
    for body, param in [({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
                         "response_format"),
                        ({"response_format": {"type": "xml"}}, "response_format"),
                        ({"turbo": {"regex": "(["}}, "response_format"),
                        ({"turbo": {"grammar": 5}}, "turbo.grammar")]:
        resp = http.post("/v1/completions", json={"model": engine.model, "prompt": PROMPT, "max_tokens": 4, **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.json())

SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 6},
                                                 "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["ok", "name", "n"], "additionalProperties": False}


def test_a_seeded_batch_holds_on_the_real_qwen35_vocabulary(qwen35_install):
    """The real tokenizer's 248,320 rows (byte-level BPE pieces, special tokens, padded rows): every
    sampled answer of a seeded batch parses and validates, and greedy speculation keeps its tokens."""
    rt = turbo.open(qwen35_install, backend="cpu")
    fmt = {"type": "json_schema", "json_schema": {"schema": SMALL_SCHEMA}}
    for seed in range(4):
        r = rt.generate("Give the record:", max_new_tokens=96, temperature=1.0, seed=seed, response_format=fmt)
        assert r.finish.reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SMALL_SCHEMA)
    plain = rt.generate("Give the record:", max_new_tokens=96, policy="off", response_format=fmt)
    spec = rt.generate("Give the record:", max_new_tokens=96, policy="fixed", block=4, drafter="ngram",
                       response_format=fmt)
    assert spec.tokens == plain.tokens and plain.finish.reason == "stop"


def test_constrained_greedy_equals_a_torch_loop_over_transformers_logits(tmp_path_factory):
    """The reference: transformers' logits, llguidance's mask for the tokens so far applied with
    plain torch, argmax; turbo plain and speculative commit the same tokens."""
    import numpy as np
    import torch

    from turbo.testing import make_spec_install

    model, path = make_spec_install(tmp_path_factory.mktemp("grammar_ref"), seed=7)
    model = model.float().eval()
    rt = turbo.open(path, backend="cpu")
    vocab, stop = rt.install.arch.vocab, 1
    regex = "[a-z]{1,5}( [a-z]{1,5}){2,5}"
    tok = llguidance.LLTokenizer((path / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=[stop])
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_regex(regex))
    prompt, out = [5, 9, 17, 23, 9, 40], []
    with torch.no_grad():
        while not matcher.is_stopped() and len(out) < 40:
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")[:vocab]
            logits[~torch.from_numpy(allowed.astype(bool))] = float("-inf")
            out.append(int(logits.argmax()))
            assert matcher.consume_token(out[-1])
    assert out[-1] == stop and len(out) > 3
    fmt = {"type": "regex", "regex": regex}
    for spec in [dict(policy="off"), dict(policy="fixed", block=4, drafter="dflash"),
                 dict(policy="fixed", block=2, drafter="dflash", rollback="replay")]:
        got = rt.generate(prompt, max_new_tokens=40, stop_at_eos=False, stop_token_ids=[stop], response_format=fmt,
                          **spec)
        assert got.tokens == out, spec

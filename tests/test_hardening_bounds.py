"""One request must not take the process down (issue 57): a schema or a Lark grammar deep enough
to overflow llguidance's stack (SIGSEGV) is measured and refused by name before it is compiled
(turbo/sequence/grammar_bounds.py), and what is accepted up to the bounds compiles; a refused regex says
why; logit_bias keys and Content-Length are read as ASCII digits; serve sizes that round to too
few bytes are refused at startup. The crashing cases run in a subprocess: a regression fails the
test (rc 139) instead of killing pytest."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_hardening_serve import MESSAGES, error_of, post, server  # noqa: F401  (a server process: tiny, 1 MiB bodies)

from turbo.errors import TurboError, ascii_decimal
from turbo.sequence import grammar_bounds
from turbo.sequence.grammar import ResponseFormat
from turbo.sequence.options import GenerationOptions

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fib(n):"


def ref_chain(n: int, nest: int = 0) -> dict:
    """A schema whose $refs chain through n $defs, each holding the next `nest` arrays deep."""
    defs = {}
    for i in range(n):
        node: dict = {"$ref": f"#/$defs/d{i + 1}"}
        for _ in range(nest):
            node = {"type": "array", "items": node}
        defs[f"d{i}"] = node
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def rule_chain(n: int) -> str:
    """A Lark grammar of n chained rules, start's included (each one ':')."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n - 2)) + f'r{n - 2}: "x"\n'


def deep_parameters() -> dict:
    """A tool's parameters whose $refs chain through 5,000 $defs: with an $id, as the forced call's
    grammar nests them under its own object (`#/$defs/...` resolves against the $id's resource)."""
    return {"$id": "urn:params", **ref_chain(5000)}


def schema(s: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}


def grammar(source: str) -> dict:
    return {"type": "grammar", "grammar": source}


def run_python(code: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter on this checkout: a segfault there is its return code, not pytest's end."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=env)


# ---- the crashing cases, through rt.generate / rt.chat, in a subprocess -----------------------

CRASHED = {  # each of these segfaulted the caller's process (llguidance 1.9.1, 8 MiB of stack)
    "schema_5000_refs": schema(ref_chain(5000)),
    "schema_100_refs_30_arrays_deep": schema(ref_chain(100, nest=30)),
    "lark_5000_rules": grammar(rule_chain(5000)),
    "lark_500_rules_of_10_groups": grammar("start: r0\n" + "".join(f'r{i}: "a" {"(" * 10}r{i + 1}{")" * 10} | "b"\n'
                                                                   for i in range(500)) + 'r500: "x"\n'),
    "lark_json_5000_refs": grammar("start: %json " + json.dumps(ref_chain(5000)) + "\n"),
}

OUTCOMES = """
import json, sys, turbo
cases, parameters = json.loads(sys.stdin.read())
rt = turbo.open("tiny", backend="cpu", threads=1)
out = {}
for name, fmt in cases.items():
    try:
        rt.generate("def fib(n):", max_new_tokens=2, response_format=fmt)
        out[name] = None
    except turbo.TurboError as e:
        out[name] = [e.field, str(e)]
tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
try:
    rt.chat([{"role": "user", "content": "hi"}], max_new_tokens=2, tools=tools, tool_choice="required",
            template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    out["forced_call_5000_refs"] = None
except turbo.TurboError as e:
    out["forced_call_5000_refs"] = [e.field, str(e)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def outcomes() -> dict:
    """What rt.generate (and rt.chat's forced tool call) made of each case, and of an unclosed
    regex, in one subprocess."""
    done = run_python(OUTCOMES, json.dumps([{**CRASHED, "regex": {"type": "regex", "regex": "([a-z"}},
                                            deep_parameters()]))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # (139 / -11: llguidance's stack overflowed)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [*CRASHED, "forced_call_5000_refs"])
def test_a_grammar_that_overflowed_llguidance_is_refused_by_name(outcomes, name):
    assert outcomes[name] is not None, name
    field, message = outcomes[name]
    assert field == "response_format" and "\n" not in message, outcomes[name]
    assert "overflows llguidance's stack" in message and "expected at most" in message, message


def test_what_the_bounds_let_through_compiles(tmp_path):
    """The worst cases at the bounds (the deepest $ref chain, through arrays, the construct that
    crashed soonest; the longest rule chain; the largest object) compile and generate: the bounds
    refuse no schema llguidance could take safely and would need."""
    depth, nest = grammar_bounds.MAX_DEPTH, 30
    cases = {"refs_at_the_bound": schema(ref_chain(depth - 3)),  # (the root, $defs, then the chain)
             "arrays_at_the_bound": schema(ref_chain((depth - 3) // (nest + 1), nest=nest)),
             "rules_at_the_bound": grammar(rule_chain(grammar_bounds.MAX_LARK_WEIGHT)),
             "5000_properties": schema({"type": "object", "required": ["p0"],
                                        "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}})}
    for fmt in cases.values():
        ResponseFormat.parse(fmt)  # (within the bounds)
    for name in ("refs_at_the_bound", "arrays_at_the_bound"):
        edges = grammar_bounds.schema_graph(cases[name]["json_schema"]["schema"], name)
        assert depth - nest <= grammar_bounds.longest_path(edges) <= depth
    code = ("import json, sys, turbo\nrt = turbo.open('tiny', backend='cpu', threads=1)\n"
            "for name, fmt in json.loads(sys.stdin.read()).items():\n"
            "    print(name, repr(rt.generate('x', max_new_tokens=2, response_format=fmt).text), flush=True)\n")
    done = run_python(code, json.dumps(cases))
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert [line.split()[0] for line in done.stdout.splitlines()] == list(cases)


def test_the_bounds_hold_on_a_thread_of_little_stack():
    """A caller's thread of 1 MiB of stack (a thread's default is 2 MiB under `ulimit -s
    unlimited`): a schema within the bounds crashed llguidance's compiler there; it compiles on a
    thread of its own stack (grammar.on_compiler_stack)."""
    at_bound = schema(ref_chain(16, nest=30))  # (499 nodes deep, through arrays: the soonest crash)
    code = ("import json, sys, threading, turbo\nrt = turbo.open('tiny', backend='cpu', threads=1)\n"
            "fmt, out = json.loads(sys.stdin.read()), []\nthreading.stack_size(1 << 20)\n"
            "t = threading.Thread(target=lambda: out.append(rt.generate('x', max_new_tokens=2, response_format=fmt)))\n"
            "t.start(); t.join(); print(len(out))\n")
    done = run_python(code, json.dumps(at_bound))
    assert done.returncode == 0 and done.stdout.strip() == "1", (done.returncode, done.stderr[-2000:])


@pytest.mark.parametrize("fmt, says", [
    (schema(ref_chain(grammar_bounds.MAX_DEPTH)), "503 subschemas deep through its nesting and $refs"),
    (schema({"$ref": "#/$defs/gone"}), '$ref "#/$defs/gone" names nothing in the schema'),
    (grammar(rule_chain(grammar_bounds.MAX_LARK_WEIGHT + 1)), "1001 rules and groups"),
    (grammar("start: %json {\"type\": \n"), "the %json at character 7 is not followed by JSON"),
    ({"type": "regex", "regex": "a" * (grammar_bounds.MAX_BYTES + 1)}, "524289 bytes, expected at most 512 KiB"),
])
def test_a_bound_is_refused_in_one_line_naming_the_field(fmt, says):
    with pytest.raises(TurboError) as e:
        GenerationOptions(response_format=fmt)
    assert e.value.field == "response_format" and says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_nesting_and_cycles_in_a_python_schema_end_in_one_line():
    """json.dumps recursed (RecursionError) over a schema nested 5,000 deep, and a dict that holds
    itself never ends: both are met by the nesting bound, walked without recursion."""
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    loop: dict = {"type": "object"}
    loop["properties"] = {"a": loop}
    shared: dict = {"type": "string"}  # 2**40 copies once written out: the object bound stops the walk
    for _ in range(40):
        shared = {"anyOf": [shared, shared]}
    for s, says in ((deep, "nested over 128 deep"), (loop, "nested over 128 deep"),
                    (shared, f"over {grammar_bounds.MAX_NODES} objects and arrays")):
        start = time.monotonic()
        with pytest.raises(TurboError, match=says):
            ResponseFormat.parse(schema(s))
        assert time.monotonic() - start < 5


def test_real_schemas_are_measured_as_json_schema_resolves_them():
    """A recursive schema (its cycle counted once), an $anchor, a relative $id, a pointer with
    escapes: all resolved, all within the bounds; their text is the one llguidance was given before."""
    tree = {"type": "object", "properties": {"v": {"type": "integer"},
                                              "kids": {"type": "array", "items": {"$ref": "#"}}}}
    anchored = {"$ref": "#leaf", "$defs": {"a": {"$anchor": "leaf", "type": "string"}}}
    by_id = {"$id": "http://example.com/root.json", "$ref": "http://example.com/a.json",
             "$defs": {"a": {"$id": "a.json", "type": "integer"}}}
    escaped = {"$ref": "#/$defs/a~1b%25", "$defs": {"a/b%": {"type": "integer"}}}
    for s in (tree, anchored, by_id, escaped):
        assert ResponseFormat.parse(schema(s)).source == json.dumps(s, sort_keys=True)
    edges = grammar_bounds.schema_graph(tree, "x")
    assert grammar_bounds.longest_path(edges) == 5  # (the cycle root, properties, kids, items; then v)


def test_the_longest_path_counts_a_cycle_once_and_a_chain_whole():
    assert grammar_bounds.longest_path([[1], [2], [3], []]) == 4
    assert grammar_bounds.longest_path([[1], [2], [0], [0]]) == 4  # (3 -> the cycle 0, 1, 2)
    assert grammar_bounds.longest_path([[1, 2], [3], [3], []]) == 3
    n = 100_000  # iterative: a chain far past Python's recursion limit
    assert grammar_bounds.longest_path([[i + 1] for i in range(n - 1)] + [[]]) == n


def test_a_refused_regex_says_why(outcomes):
    """llguidance says why under the regex and its caret: the one line keeps that line."""
    field, message = outcomes["regex"]
    assert field == "response_format" and message.endswith("regex parse error: unclosed character class"), message


# ---- logit_bias keys and Content-Length: ASCII digits --------------------------------------------


@pytest.mark.parametrize("key", ["²", "٣", "9" * 5000, "-1", " 3", "3 ", "+3", "", "0x10", "3.0", "1_0"],
                         ids=["superscript-2", "arabic-indic-3", "5000-digits", "-1", "space-3", "3-space", "+3",
                              "empty", "hex", "3.0", "1_0"])
def test_a_logit_bias_key_is_a_token_ids_ascii_digits(key):
    start = time.monotonic()
    with pytest.raises(TurboError) as e:
        GenerationOptions(logit_bias={key: 1.0})
    assert e.value.field == "logit_bias" and "not a token id in ASCII decimal digits" in str(e.value)
    assert len(str(e.value)) < 600 and time.monotonic() - start < 1  # (the map and the key: 200 characters each)


def test_ascii_digit_keys_and_integers_are_token_ids():
    assert GenerationOptions(logit_bias={"3": 1, "0010": -2, 7: 0.5}).logit_bias == ((3, 1.0), (7, 0.5), (10, -2.0))
    assert ascii_decimal("٣", 9) is None and ascii_decimal("²", 9) is None and ascii_decimal(b"12", 9) == 12


def test_a_content_length_that_is_no_ascii_number_is_no_500():
    """The head's Content-Length: "²" (latin-1 0xB2, which str.isdigit took and int() refused) is
    no number, the body is read with the cap; thousands of digits are over any limit (a 413)."""
    from turbo.serve.guard import Guard
    from turbo.serve.limits import declared_length, read_body

    assert declared_length("²") == 0 and declared_length(b"\xb2") == 0 and declared_length(" 12 ") == 12
    assert declared_length("9" * 5000) > 1 << 62 and declared_length(b"9" * 5000) > 1 << 62

    async def chunks():
        yield b"{}"

    assert asyncio.run(read_body(chunks(), 100, "²")) == b"{}"
    guard = Guard(None, None, 100)
    scope = {"type": "http", "path": "/v1/completions", "headers": [(b"content-length", b"9" * 5000)]}
    assert guard.refusal(scope).status == 413
    assert guard.refusal({**scope, "headers": [(b"content-length", b"\xb2")]}) is None


# ---- serve settings that round to nothing ----------------------------------------------------------


@pytest.mark.parametrize("serve, says", [
    ({"max_body_mb": 1e-9}, "serve.max_body_mb=1e-09, expected a number of MB > 0 (1e-09 MB is 0 bytes"),
    ({"max_body_mb": 0.0005}, "0.0005 MB is 524 bytes, under the 1 KiB a request's body needs"),
    ({"memory_gb": 1e-12}, "serve.memory_gb=1e-12, expected a number of GB > 0 (1e-12 GB is 0 bytes"),
    ({"memory_gb": 0}, "serve.memory_gb=0, expected a number of GB > 0"),
    ({"cache_gb": 1e-12}, "1e-12 GB is 0 bytes; 0 turns the prefix cache off"),
])
def test_a_size_that_rounds_to_nothing_is_refused(serve, says):
    from turbo.serve.settings import serve_config

    base = OmegaConf.load(ROOT / "conf" / "task" / "serve.yaml")
    with pytest.raises(TurboError) as e:
        serve_config(OmegaConf.merge(base, {"serve": serve}))
    assert says in str(e.value), str(e.value)
    config = serve_config(OmegaConf.merge(base, {"serve": {"cache_gb": 0, "max_body_mb": 0.001}}))
    assert config.limits.cache_gb == 0 and config.max_body_mb == 0.001  # (no cache; 1048 bytes)


def test_the_command_line_refuses_it_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "turbo", "task=serve", "serve.port=0", "serve.max_body_mb=1e-9"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert "serve.max_body_mb=1e-09" in done.stderr and "0 bytes" in done.stderr


# ---- over HTTP: a 400 naming the field, and the next request answered --------------------------


def test_the_server_answers_400_naming_the_field_and_then_the_next_request(server):
    """The cases that killed the engine (and the front with it), and logit_bias keys that were a
    500: each a 400 naming its field; the same server then answers."""
    deep = CRASHED["schema_5000_refs"]
    for route, body, param in [
            ("/v1/completions", {"response_format": deep}, "response_format"),
            ("/v1/completions", {"turbo": {"grammar": CRASHED["lark_5000_rules"]["grammar"]}}, "response_format"),
            ("/v1/completions", {"logit_bias": {"²": 1}}, "logit_bias"),
            ("/v1/completions", {"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
            ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required", "tools": [
                {"type": "function", "function": {"name": "f", "parameters": deep_parameters()}}]}, "tools")]:
        body = {"model": "tiny", "max_tokens": 2, **({} if "messages" in body else {"prompt": PROMPT}), **body}
        err = error_of(post(server, body, route), 400)
        assert err["param"] == param and "\n" not in err["message"], (body.keys(), err)
    r = post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] and server.proc.poll() is None

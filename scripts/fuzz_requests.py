"""scripts/fuzz.py's request-shaped classes: the server's requests whose parts reach a compiler or a
parser, at depth and at size -- JSON schemas (response_format), Lark grammars and regexes
(turbo.grammar), tools (their parameter schemas, names with odd characters, the forced call's
grammar), tool calls and tool results sent back.

    python -m scripts.fuzz --requests N [--seed S] [--timeout T]

Each case is posted to the app over one worker.Engine on tiny (fastapi's TestClient; serve.max_body_mb=4)
in a worker subprocess (scripts/fuzz.py's Worker): a case that kills it (a native library's stack
overflow) is counted as `crash` and the worker restarted, one that outlives --timeout as `hang`.
Every 25 cases the unmutated request is sent again and must give the reference text. Outcomes
(scripts/fuzz_inputs.py's): error-4xx and served are ok; error-5xx, error-malformed, other-exception,
served-changed, crash and hang are BAD.

Deep values are written as text: json.dumps recurses, and these go deeper than its limit.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

from scripts import fuzz_inputs

DEPTHS = (10, 100, 1000, 5000)
COUNTS = (10, 500, 2000, 5000)
LENGTHS = (1, 64, 1000)
ODD = ['"', "\\", "'", "\n", "\x00", "\x1b", "\u202e", "💥", "}", "{", "<", ">", "/", "|", "#", "$", "%",
       "<|im_end|>", "</tool_call>", "</parameter>", "<function=x>", "${x}", "{{ 7*7 }}", " "]
INJECTIONS = ['get" | /[\\s\\S]{0,40}/ | "x', "a>b", "a</parameter>b", "</function>", 'x" }', "\\u0022", "a b", ""]
XML_TEMPLATE = (  # a template in the <function=...> call format (turbo/chat/tool_calls.py reads the format off its source)
    "{%- if tools %}{{ '<|im_start|>system\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nCall one as <tool_call>\\n<function=NAME>\\n<parameter=P>\\nV\\n</parameter>\\n</function>"
    "\\n</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] if m['content'] is string else '')"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
GOOD = fuzz_inputs.GOOD  # the unmutated requests: sent again every 25 cases, their text must not change
TOKENS = 4  # each case's max_tokens: enough to start the grammar's matcher on real output


def odd_name(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(ODD + ["a", "b", "_", "1"]) for _ in range(length))[:length] or "a"


def nested(depth: int, opening: str, leaf: str, closing: str) -> str:
    """`opening` depth times around `leaf`, each closed by `closing` (text: no recursion)."""
    return opening * depth + leaf + closing * depth


def j(value: Any) -> str:
    return json.dumps(value)


# ---- JSON schemas ---------------------------------------------------------------------------------

def schema_deep_objects(rng):
    d = rng.choice(DEPTHS)
    return nested(d, '{"type": "object", "properties": {"a": ', '{"type": "string"}',
                  '}, "required": ["a"]}')


def schema_deep_arrays(rng):
    return nested(rng.choice(DEPTHS), '{"type": "array", "items": ', '{"type": "integer"}', "}")


def schema_deep_anyof(rng):
    return nested(rng.choice(DEPTHS), '{"anyOf": [{"type": "null"}, ', '{"type": "boolean"}', "]}")


def schema_ref_chain(rng):
    n = rng.choice(COUNTS)
    defs = ", ".join(f'"d{i}": {{"$ref": "#/$defs/d{i + 1}"}}' for i in range(n))
    return f'{{"$ref": "#/$defs/d0", "$defs": {{{defs}, "d{n}": {{"type": "string"}}}}}}'


def schema_wide(rng):
    n, length = rng.choice(COUNTS[:3]), rng.choice(LENGTHS)
    names = list(dict.fromkeys(odd_name(rng, length) + str(i) for i in range(n)))
    return j({"type": "object", "properties": {k: {"type": rng.choice(["string", "integer", "boolean"])} for k in names},
              "required": names[:rng.randint(0, len(names))]})


def schema_odd(rng):
    return j(rng.choice([
        {"type": "object", "properties": {odd_name(rng, 8): {"enum": [odd_name(rng, 5) for _ in range(5)]}}},
        {"type": "string", "pattern": rng.choice(["(((", "a{100000}", "[", "\\", "(a|b)*" * 200, "\\p{Nope}"])},
        {"type": "string", "minLength": rng.choice([10**20, -1, 2**64]), "maxLength": 3},
        {"type": rng.choice(["nonsense", 5, [], ["string", "nonsense"]])},
        {"$ref": rng.choice(["#/nope", "http://example.com/s.json", "#", "#/$defs/" + odd_name(rng, 6)])},
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"], "additionalProperties": False},
        {"enum": []}, {"not": {}}, {"allOf": [{"type": "string"}, {"type": "integer"}]},
        {"type": "array", "items": {"type": "integer"}, "minItems": 10**9},
        {"type": "string", "format": rng.choice(["date-time", "email", "uuid", "nope"])},
        {"type": "number", "minimum": 5, "maximum": 1}, {"const": odd_name(rng, 30)},
    ]))


# ---- Lark grammars and regexes -----------------------------------------------------------------

def grammar_chain(rng):
    n = rng.choice(COUNTS)
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(n)) + f'r{n}: "z"\n'


def grammar_wide(rng):
    n, length = rng.choice(COUNTS), rng.choice(LENGTHS)
    return "start: " + " | ".join(j(odd_name(rng, length) + str(i)) for i in range(n)) + "\n"


def grammar_deep_parens(rng):
    return "start: " + nested(rng.choice(DEPTHS), '("a" ', '"z"', ")*") + "\n"


def grammar_odd(rng):
    name = "".join(rng.choice("abc_XYZ019") for _ in range(rng.choice(LENGTHS)))
    return rng.choice([
        f"start: {name}\n{name}: {j(odd_name(rng, 20))}\n",
        "start: a\na: a a | \"x\"\n", "start: undefined_rule\n", "a: \"x\"\n", "start: /(((/\n",
        "start: \"\"\n", 'start: /[\\s\\S]*/\n', "start: " + "x" * 5000 + "\n", "%import common.WORD\nstart: WORD\n",
        'start: "' + odd_name(rng, 50).replace('"', "") + '"\n', "start: a\na: b\nb: a\n",
    ])


def regex_deep(rng):
    d = rng.choice(DEPTHS)
    return rng.choice([nested(d, "(", "a", ")"), nested(d, "(?:", "a", ")*"),
                       "|".join(f"w{i}" for i in range(rng.choice(COUNTS))), "a{" + str(rng.choice([1000, 10**6, 10**12])) + "}",
                       odd_name(rng, rng.choice(LENGTHS))])


# ---- tools, tool calls, tool results -------------------------------------------------------------

def tool(name: str, params: str = '{"type": "object", "properties": {"a": {"type": "string"}}}') -> str:
    return f'{{"type": "function", "function": {{"name": {j(name)}, "description": "d", "parameters": {params}}}}}'


def choice_of(rng: random.Random, names: list[str]) -> str:
    return rng.choice(['"auto"', '"required"', '"none"', '{"type": "function", "function": {"name": ' +
                       j(rng.choice(names)) + "}}"])


def tools_many(rng):
    n, length = rng.choice(COUNTS), rng.choice(LENGTHS)
    names = list(dict.fromkeys("f" + "".join(rng.choice("abcxyz_09") for _ in range(length)) + str(i) for i in range(n)))
    return ", ".join(tool(k) for k in names), choice_of(rng, names)


def tools_deep_params(rng):
    params = nested(rng.choice(DEPTHS), '{"type": "object", "properties": {"a": ', '{"type": "string"}', "}}")
    return tool("f", params), rng.choice(['"required"', '"auto"'])


def tools_odd_names(rng):
    name = rng.choice(INJECTIONS + [odd_name(rng, rng.choice(LENGTHS))])
    param = rng.choice(INJECTIONS + [odd_name(rng, 10), "a"])
    params = j({"type": "object", "properties": {param: {"type": rng.choice(["string", "integer", "object"])}},
                "required": [param]})
    return tool(name, params), choice_of(rng, [name])


def conversation(call_arguments: str, result: str) -> str:
    """A user turn, the assistant's call of f with `call_arguments` (a JSON text), f's `result` (text)."""
    return ('[{"role": "user", "content": "go"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", '
            '"type": "function", "function": {"name": "f", "arguments": ' + j(call_arguments) + '}}]}, '
            '{"role": "tool", "tool_call_id": "c1", "content": ' + j(result) + "}]")


def deep_json(rng: random.Random, depth: int) -> str:
    opens = [rng.choice(("[", '{"a": ')) for _ in range(depth)]
    return "".join(opens) + '"x"' + "".join("]" if o == "[" else "}" for o in reversed(opens))


def tool_results_deep(rng):
    deep = deep_json(rng, rng.choice(DEPTHS))
    return conversation(rng.choice([deep, '{"a": 1}']), rng.choice([deep, "ok"]))


def tool_results_large(rng):
    size = rng.choice([1 << 10, 100 << 10, 900 << 10])
    parts = rng.choice(["text", "parts", "many-calls"])
    if parts == "many-calls":
        calls = ", ".join('{"id": "c%d", "type": "function", "function": {"name": "f", "arguments": "{}"}}' % i
                          for i in range(rng.choice(COUNTS)))
        return ('[{"role": "user", "content": "go"}, {"role": "assistant", "content": null, "tool_calls": [' + calls
                + ']}, {"role": "tool", "tool_call_id": "c0", "content": "ok"}]')
    result = odd_name(rng, 64) * (size // 64)
    if parts == "parts":
        result = j([{"type": "text", "text": result}])
        return conversation("{}", "@@").replace('"@@"', result)
    return conversation("{}", result)


SCHEMAS = {"schema-deep-objects": schema_deep_objects, "schema-deep-arrays": schema_deep_arrays,
           "schema-deep-anyof": schema_deep_anyof, "schema-ref-chain": schema_ref_chain, "schema-wide": schema_wide,
           "schema-odd": schema_odd}
GRAMMARS = {"grammar-chain": grammar_chain, "grammar-wide": grammar_wide, "grammar-deep-parens": grammar_deep_parens,
            "grammar-odd": grammar_odd}
TOOLS = {"tools-many": tools_many, "tools-deep-params": tools_deep_params, "tools-odd-names": tools_odd_names}
RESULTS = {"tool-results-deep": tool_results_deep, "tool-results-large": tool_results_large}
CLASSES = [*SCHEMAS, *GRAMMARS, "regex-deep", *TOOLS, *RESULTS]


def request_case(cls: str, rng: random.Random) -> tuple[str, str, str]:
    """(route, template: "own" | "xml", the body as JSON text) of one case of class `cls`."""
    head = f'"model": "tiny", "max_tokens": {TOKENS}, "temperature": 0'
    if cls in SCHEMAS or cls in GRAMMARS or cls == "regex-deep":
        if cls in SCHEMAS:
            fmt = '{"type": "json_schema", "json_schema": {"name": "s", "schema": ' + SCHEMAS[cls](rng) + "}}"
        elif cls in GRAMMARS:
            fmt = '{"type": "grammar", "grammar": ' + j(GRAMMARS[cls](rng)) + "}"
        else:
            fmt = '{"type": "regex", "regex": ' + j(regex_deep(rng)) + "}"
        if rng.random() < 0.5:
            return "/v1/completions", "own", f'{{{head}, "prompt": "x", "response_format": {fmt}}}'
        return "/v1/chat/completions", "own", \
            f'{{{head}, "messages": [{{"role": "user", "content": "x"}}], "response_format": {fmt}}}'
    template = rng.choice(["own", "xml"])  # tiny's own template writes calls as JSON; the other as <function=...>
    if cls in TOOLS:
        tools, choice = TOOLS[cls](rng)
        return "/v1/chat/completions", template, (f'{{{head}, "messages": [{{"role": "user", "content": "x"}}], '
                                                  f'"tools": [{tools}], "tool_choice": {choice}}}')
    messages = RESULTS[cls](rng)
    return "/v1/chat/completions", template, f'{{{head}, "messages": {messages}, "tools": [{tool("f")}]}}'


# ---- the worker's side (in scripts/fuzz.py's worker process) ------------------------------------

def reply(job: dict, apps: dict) -> dict:
    """Post one case to the app of its template (made on first use): its outcome (fuzz_inputs._judge's)
    and, for a 200, its text."""
    if job["template"] not in apps:
        apps[job["template"]] = _client(job["template"])
    try:
        r = apps[job["template"]].post(job["route"], content=job["body"].encode("utf-8", "surrogatepass"),
                                       headers={"content-type": "application/json"})
    except Exception as e:  # noqa: BLE001 (the finding)
        return {"result": "request", "outcome": "other-exception", "message": f"{type(e).__name__}: {e}"[:300]}
    outcome, detail = fuzz_inputs._judge(job["cls"], job["route"], r, {})
    text = fuzz_inputs._text(job["route"], r.json()) if outcome == "served" else None
    return {"result": "request", "outcome": outcome, "message": detail, "text": text}


def _client(template: str):
    """A TestClient over a started worker.Engine on tiny: its own template, or XML_TEMPLATE."""
    from fastapi.testclient import TestClient  # (the serve extra, and torch: the worker's alone)

    from turbo.sequence.options import GenerationOptions, OpenOptions
    from turbo.serve.app import make_app
    from turbo.serve.settings import ServeConfig
    from turbo.serve.worker import Engine

    path = None
    if template == "xml":
        path = Path(tempfile.mkdtemp(prefix="turbo-fuzz-requests-")) / "xml.jinja"
        path.write_text(XML_TEMPLATE)
    config = ServeConfig(chat_template=None if path is None else str(path), max_body_mb=4.0)
    engine = Engine("tiny", OpenOptions(backend="cpu", threads=1), GenerationOptions(), config)
    engine.start()
    return TestClient(make_app(engine), raise_server_exceptions=False)

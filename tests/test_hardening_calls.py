"""Tool calls, their results and the data templates walk, hardened (issue 57): model output or
request data nested past turbo/bounded.py's MAX_NESTING is text (a call) or refused by name (a
request), never a RecursionError; the XML call parser is linear; names are escaped into the call
grammar and refused where the template's call format cannot carry them; NaN / Infinity make a
call text, so `arguments` is always strict JSON; tools files are read bounded; rt.chat takes
add_generation_prompt and refuses content and system prompts that are not text; the server
refuses chat_template_kwargs the template does not read, as rt.chat does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import turbo
from turbo.bounded import MAX_NESTING, SMALL_FILE_BYTES, text_nesting
from turbo.chat.reasoning import ReasoningStream
from turbo.chat.template import encode, install_template
from turbo.chat.tool_calls import CallStream, ToolCall, call_grammar, parse_tool_calls
from turbo.chat.turn import template_messages
from turbo.chat_cli import load_tools
from turbo.errors import TurboError

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}, "note": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Add 1 and 2."}]
# tiny's template, its tools written in Qwen3.5's <function=NAME> call format
XML_TEMPLATE = (ROOT / "turbo" / "installs" / "tiny" / "chat_template.jinja").read_text().replace(
    '{"name": NAME, "arguments": ARGS}', "<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>")
EVIL = 'get" | /[\\s\\S]{0,40}/ | "x'  # a tool name that was grammar once pasted into the call's Lark grammar


def deep(n: int) -> str:
    return "[" * n + "1" + "]" * n


def nested(n: int, leaf: object = 1) -> object:
    """deep(n) as a value, built by a loop (json.loads would recurse)."""
    for _ in range(n):
        leaf = [leaf]
    return leaf


def timed(fn, seconds: float = 3.0):
    start = time.monotonic()
    out = fn()
    assert time.monotonic() - start < seconds, f"took {time.monotonic() - start:.1f} s"
    return out


@pytest.fixture(scope="module")
def rt():
    return turbo.open("tiny", backend="cpu", threads=1)


# ---- model output: a call that cannot be read is text, with the reason -----------------------


@pytest.mark.parametrize("n", [MAX_NESTING + 1, 1000, 100_000])
def test_deeply_nested_call_arguments_are_text_not_a_recursion_error(n):
    for text in (f'<tool_call>\n{{"name": "add", "arguments": {{"a": {deep(n)}}}}}\n</tool_call>',
                 f'<tool_call>\n{{"name": "add", "arguments": "{{\\"a\\": {deep(n)}}}"}}\n</tool_call>',
                 f"<tool_call>\n<function=add>\n<parameter=a>\n{deep(n)}\n</parameter>\n</function>\n</tool_call>"):
        content, calls, why = timed(lambda: parse_tool_calls(text, TOOLS))
        assert content == text and calls == [] and "levels deep, over the limit of 64" in why, why


def test_arguments_nested_within_the_bound_are_read():
    text = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {deep(MAX_NESTING - 2)}}}}}\n</tool_call>'
    _, (call,), why = parse_tool_calls(text, TOOLS)
    assert why is None and text_nesting(call.arguments) == MAX_NESTING - 1  # (the call object is one more)


@pytest.mark.parametrize("body", [
    "<function=add>\n" + "<parameter=a>" * 30_000 + "\n</function>",
    "<function=add>\n" + "<parameter=" * 30_000 + "\n</function>",
    "<function=add>\n" + "<parameter=a\n" * 30_000 + "</function>",
    "<function=add>\n" + "<parameter=a>\n1\n</parameter>\n" * 30_000 + "</function>",
])
def test_the_xml_call_parser_is_linear(body):
    """30,000 unclosed <parameter=a> took over 75 s (each start scanned to the end again)."""
    for text in (f"<tool_call>\n{body}\n</tool_call>", "<tool_call>" * 30_000 + body):
        timed(lambda: parse_tool_calls(text, TOOLS), 2.0)


@pytest.mark.parametrize("args", ['{"a": NaN, "b": 1}', '{"a": -Infinity}', '{"a": 1e999}', '"{\\"a\\": Infinity}"'])
def test_non_finite_arguments_are_text_not_a_call(args):
    text = f'<tool_call>\n{{"name": "add", "arguments": {args}}}\n</tool_call>'
    content, calls, why = parse_tool_calls(text, TOOLS)
    assert content == text and calls == [] and "not a finite number" in why, why


def test_non_finite_xml_values_are_text_and_read_calls_are_strict_json():
    for value in ("NaN", "Infinity", "-Infinity", "1e400", "[1, NaN]"):
        text = f"<tool_call>\n<function=add>\n<parameter=a>\n{value}\n</parameter>\n</function>\n</tool_call>"
        content, calls, why = parse_tool_calls(text, TOOLS)
        assert content == text and calls == [] and "not strict JSON" in why, (value, why)
    # a string parameter holding the text NaN is text; so is an untyped one that is not JSON at all
    text = "<tool_call>\n<function=add>\n<parameter=a>\n1.5\n</parameter>\n<parameter=note>\nNaN\n</parameter>\n" \
           "<parameter=more>\nInfinity and beyond\n</parameter>\n</function>\n</tool_call>"
    _, (call,), _ = parse_tool_calls(text, TOOLS)

    def refuse(name):
        raise ValueError(name)
    assert json.loads(call.arguments, parse_constant=refuse) == {"a": 1.5, "note": "NaN", "more": "Infinity and beyond"}


def test_streamed_answers_are_split_and_held_back_in_linear_time():
    """64,000 pieces of reasoning then content (512 KB): the server's reasoning split and call
    hold-back rescanned and copied the whole answer at every piece (20 s and more; minutes at 1 MB)."""
    reasoning, content, calls = ReasoningStream(True), [], CallStream(TOOLS)
    pieces = ["abcdefgh"] * 32_000 + ["</think>"] + ["ijklmnop"] * 32_000

    def run() -> list[str]:
        sent = []
        for i, piece in enumerate(pieces):
            think, text = reasoning.feed(piece, i == len(pieces) - 1)
            content.append(think)
            sent.append(calls.feed(text))
        return sent
    sent = timed(run, 5.0)
    assert "".join(content) == "abcdefgh" * 32_000 and "".join(sent) + calls.end()[0] == "ijklmnop" * 32_000


# ---- request data: refused by name ------------------------------------------------------------


def test_deep_tool_results_are_refused_by_name_and_leave_the_session(rt):
    s = rt.session(tools=TOOLS)
    call = ToolCall("add", '{"a": 1, "b": 2}')
    s.history += [dict(ASK[0]), {"role": "assistant", "content": None, "tool_calls": [call.openai()]}]
    before = [dict(m) for m in s.history]
    with pytest.raises(TurboError) as e:
        s.send_tool_results({call.id: {"r": nested(5000)}})
    assert e.value.field == "results" and f"tool result for {call.id} is nested more than 64" in str(e.value)
    assert s.history == before and s.pending_calls[0].id == call.id


def test_deep_messages_tools_and_arguments_are_refused_by_name(rt):
    deep_args = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": nested(5000)}}}]}
    with pytest.raises(TurboError) as e:
        rt.chat(ASK + [deep_args, {"role": "tool", "tool_call_id": "c", "content": "3"}], max_new_tokens=1)
    assert e.value.field == "messages" and "nested more than 128" in str(e.value)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"items": nested(5000, {})}}}}}]
    with pytest.raises(TurboError) as e:
        rt.chat(ASK, tools=tools, max_new_tokens=1)
    assert e.value.field == "tools" and "nested more than 64" in str(e.value)  # (check_tools: each a value)
    # a client's arguments as JSON text, nested past the bound: left as text for the template, not a RecursionError
    text_args = {**deep_args, "tool_calls": [{"id": "c", "function": {"name": "add", "arguments": deep(100_000)}}]}
    assert timed(lambda: template_messages([text_args]))[0]["tool_calls"][0]["function"]["arguments"] == deep(100_000)


def one_line(args: list[str], cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "turbo", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, input="", env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_task_chat_tools_and_template_files_are_read_bounded(tmp_path):
    (tmp_path / "deep.json").write_text(deep(100_000))
    (tmp_path / "nan.json").write_text('[{"type": "function", "function": {"name": "f", "x": NaN}}]')
    for arg, says in (("tools=deep.json", "nests 100000 levels deep, over the limit of 64"),
                      ("tools=/dev/zero", "tools file /dev/zero: not a regular file"),
                      ("tools=nan.json", "holds NaN"),
                      ("chat_template=/dev/zero", "chat template /dev/zero: not a regular file")):
        err = timed(lambda: one_line(["task=chat", "threads=1", "backend=cpu", arg], tmp_path), 120)
        assert says in err, err
    err = timed(lambda: one_line(["task=serve", "threads=1", "backend=cpu", "serve.port=0",
                                  "serve.chat_template=/dev/zero"], tmp_path), 120)
    assert "serve.chat_template=/dev/zero: not a regular file" in err, err


def test_tools_files_over_the_limit_or_not_files_are_refused(tmp_path):
    (tmp_path / "big.json").write_text(" " * SMALL_FILE_BYTES + "[]")
    os.mkfifo(tmp_path / "pipe.json")
    for path, says in (("big.json", f"over the {SMALL_FILE_BYTES >> 20} MiB limit"),
                       ("pipe.json", "not a regular file"), (".", "not a regular file")):
        with pytest.raises(TurboError) as e:
            timed(lambda: load_tools(str(tmp_path / path)))
        assert e.value.field == "tools" and says in str(e.value), str(e.value)
    (tmp_path / "ok.json").write_text(json.dumps(TOOLS))
    assert load_tools(str(tmp_path / "ok.json")) == TOOLS


# ---- names: escaped into the grammar, refused where the format cannot carry them ---------------


def test_a_tool_name_is_never_grammar(rt):
    """A tool named like Lark grammar, forced: the answer is that tool's call (before, the name
    opened the grammar to 40 characters of any text)."""
    tools = [{"type": "function", "function": {"name": EVIL, "parameters": {"type": "object", "properties": {}}}}]
    got = rt.chat(ASK, tools=tools, tool_choice="required", template=XML_TEMPLATE, max_new_tokens=200)
    assert [c["function"]["name"] for c in got.message.get("tool_calls", [])] == [EVIL], got.text
    assert json.loads(got.message["tool_calls"][0]["function"]["arguments"]) == {}
    json_form = [{"type": "function", "function": {**tools[0]["function"], "name": EVIL + '}\n'}}]  # (tiny's own)
    got = rt.chat(ASK, tools=json_form, tool_choice="required", max_new_tokens=200)
    assert [c["function"]["name"] for c in got.message.get("tool_calls", [])] == [EVIL + '}\n'], got.text
    llguidance = pytest.importorskip("llguidance")
    grammar = call_grammar(tools + TOOLS, None, xml=True)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""


@pytest.mark.parametrize("name, param", [("a>b", None), ("a<b", None), ("two\nlines", None), (" a", None),
                                         ("f", "a>b"), ("f", "x\ny"), ("f", "")])
def test_names_the_xml_format_cannot_carry_are_refused_by_name(rt, name, param):
    props = {param: {"type": "string"}} if param is not None else {}
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}]
    for attempt in (lambda: rt.chat(ASK, tools=tools, template=XML_TEMPLATE, max_new_tokens=1),
                    lambda: rt.session(tools=tools, template=XML_TEMPLATE)):
        with pytest.raises(TurboError) as e:
            attempt()
        assert e.value.field == "tools[0]" and "cannot be written in the template's" in str(e.value)
    rt.chat(ASK, tools=tools, max_new_tokens=1)  # the JSON format (tiny's own template) carries any name


# ---- the leftovers: add_generation_prompt, content and system prompts that are not text ----------


def test_rt_chat_takes_add_generation_prompt_as_transformers_does(rt):
    messages = ASK + [{"role": "assistant", "content": "3"}]
    got = rt.chat(messages, add_generation_prompt=False, max_new_tokens=2)
    plain = install_template(rt.install).render(messages, add_generation_prompt=False)
    assert got.prompt_tokens == encode(rt.tokenizer, plain) and not plain.endswith("<|im_start|>assistant\n")
    assert rt.chat(ASK, max_new_tokens=2).prompt_tokens != rt.chat(ASK, max_new_tokens=2,
                                                                   add_generation_prompt=False).prompt_tokens
    with pytest.raises(TurboError) as e:
        rt.chat(ASK, add_generation_prompt="yes")
    assert e.value.field == "add_generation_prompt"
    with pytest.raises(TurboError) as e:
        rt.session(add_generation_prompt=False)
    assert e.value.field == "add_generation_prompt" and "not a template keyword here" in str(e.value)


@pytest.mark.parametrize("content", [b"Hello", {"Hello"}, 3])
def test_content_that_is_not_text_is_refused_by_name(rt, content):
    with pytest.raises(TurboError) as e:
        rt.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}], max_new_tokens=1)
    assert e.value.field == "messages[1].content" and type(content).__name__ in str(e.value)


def test_a_system_prompt_that_is_not_text_is_refused_by_name(rt):
    s = rt.session("Be brief.")
    for bad in (b"x", 3, ["x"]):
        with pytest.raises(TurboError) as e:
            s.system = bad
        assert e.value.field == "system" and s.system == "Be brief."
    with pytest.raises(TurboError) as e:
        rt.session(b"x")
    assert e.value.field == "system"


# ---- over HTTP: the same rules, and the server goes on -------------------------------------------


@pytest.fixture(scope="module")
def xml_server(tmp_path_factory):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from turbo.sequence.options import GenerationOptions, OpenOptions
    from turbo.serve.app import make_app
    from turbo.serve.settings import ServeConfig, server_defaults
    from turbo.serve.worker import Engine

    path = tmp_path_factory.mktemp("xml") / "xml.jinja"
    path.write_text(XML_TEMPLATE)
    engine = Engine("tiny", OpenOptions(backend="cpu", threads=1), server_defaults(GenerationOptions()),
                    ServeConfig(chat_template=str(path)))
    engine.start()
    try:
        yield SimpleNamespace(engine=engine, http=TestClient(make_app(engine)))
    finally:
        engine.stop()


def post(server, **body):
    return server.http.post("/v1/chat/completions", json={"model": server.engine.model, "messages": ASK,
                                                          "max_tokens": 2, **body})


def still_serving(server) -> None:
    r = post(server)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("kwargs, param", [({"nope": 1}, "chat_template_kwargs.nope"),
                                           ({"enable_thinkin": False}, "chat_template_kwargs.enable_thinkin"),
                                           ({"messages": []}, "chat_template_kwargs.messages")])
def test_chat_template_kwargs_the_template_does_not_read_are_refused(xml_server, rt, kwargs, param):
    r = post(xml_server, chat_template_kwargs=kwargs)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(TurboError) as e:  # the library's rule, the same field
        rt.session(template=XML_TEMPLATE, **kwargs)
    assert e.value.field == param.split(".")[1]
    still_serving(xml_server)
    assert post(xml_server, chat_template_kwargs={"enable_thinking": False}).status_code == 200


def test_names_over_http_escaped_or_refused_by_name(xml_server):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": {"a>b": {"type": "string"}}}}}]
    r = post(xml_server, tools=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]", r.text
    still_serving(xml_server)
    evil = [{"type": "function", "function": {"name": EVIL, "parameters": {"type": "object", "properties": {}}}}]
    r = post(xml_server, tools=evil, tool_choice="required", max_tokens=200)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in message.get("tool_calls") or []] == [EVIL], message


def test_a_deeply_nested_call_over_http_is_content_with_its_reason(xml_server):
    """The model's answer held (turbo.regex) to a call whose arguments nest 1,000 deep: it was a
    RecursionError and a 500; now the text is the content and tool_call_error says why, streamed
    or not, and the server answers the next request."""
    text = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {deep(1000)}}}}}\n</tool_call>'
    body = dict(tools=TOOLS, max_tokens=1800, turbo={"regex": re.escape(text)})
    message = post(xml_server, **body).json()["choices"][0]["message"]
    assert message["content"] == text and "tool_call_error" in message and "tool_calls" not in message, message
    assert "nests 1002 levels deep, over the limit of 64" in message["tool_call_error"]
    events = [json.loads(line[6:]) for line in post(xml_server, stream=True, **body).text.splitlines()
              if line.startswith("data: {")]
    assert not any("error" in e for e in events)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == text
    still_serving(xml_server)


def test_deep_client_arguments_over_http_are_a_400_or_text_never_a_500(xml_server):
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": deep(100_000)}}]},
        {"role": "tool", "tool_call_id": "c", "content": "3"}]
    r = timed(lambda: post(xml_server, messages=turn), 60)  # (the arguments stay JSON text for the template)
    assert r.status_code == 200 or r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    # within the bound: read as an object for the template (its messages may nest deeper than one value)
    turn[1]["tool_calls"][0]["function"]["arguments"] = '{"a": ' + deep(MAX_NESTING - 2) + "}"
    assert post(xml_server, messages=turn).status_code == 200
    still_serving(xml_server)

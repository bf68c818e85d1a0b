"""Tool calls (turbo/chat/tool_calls.py): the calls read from both Qwen formats, typed by the tool's
schema, malformed ones returned as text with the reason; through the official `openai` client a
round trip (tools -> tool_calls -> a `tool` result -> an answer), streamed and not, for every
tool_choice; the same through `rt.chat`; bad tools and choices refused naming the field."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from turbo.chat.tool_calls import CallStream, call_grammar, parse_tool_calls, tool_functions
from turbo.chat.turn import template_messages
from turbo.errors import TurboError
from turbo.serve.protocol import parse

jsonschema = pytest.importorskip("jsonschema")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "properties": {"city": {"type": "string", "maxLength": 12},
                                                                         "days": {"type": "integer"}},
                                                          "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
             "required": ["a", "b"], "additionalProperties": False}}}]
XML = ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
       "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n"
       "1.5\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>")


def test_both_formats_are_read_and_typed_by_the_schema():
    content, calls, why = parse_tool_calls(XML, TOOLS)
    assert why is None and content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3}),
                                                                  ("add", {"a": 1.5, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    content, calls, why = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
                                           TOOLS)
    assert (content, why, calls[0].name, json.loads(calls[0].arguments)) == (None, None, "add", {"a": 1, "b": 2})
    assert parse_tool_calls("no calls here", TOOLS) == ("no calls here", [], None)


@pytest.mark.parametrize("text, says", [
    ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>", "without its </tool_call>"),
    ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "'nope' is not one of the request's tools"),
    ("<tool_call>\n{not json}\n</tool_call>", "not JSON"),
    ('<tool_call>\n{"name": "add", "arguments": "[1]"}\n</tool_call>', "arguments are not a JSON object"),
    ("<tool_call>\nadd(1, 2)\n</tool_call>", "expected <function=NAME>"),
    ('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call> and then more', "text after the tool calls"),
])
def test_a_malformed_call_is_text_with_its_reason(text, says):
    content, calls, why = parse_tool_calls(text, TOOLS)
    assert content == text and calls == [] and says in why


def test_a_streamed_answer_holds_back_what_may_begin_a_call():
    stream, sent = CallStream(TOOLS), []
    for piece in ["Let me", " look.\n<tool", "_call>\n<function=get", "_weather>\n<parameter=city>\nParis\n</parameter>",
                  "\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"]:
        sent.append(stream.feed(piece))
    rest, calls, why = stream.end()
    assert "".join(sent) == "Let me look.\n" and rest == "" and why is None and calls[0].name == "get_weather"
    held = CallStream(TOOLS)
    assert held.feed("a <tool") == "a " and held.feed("box>") == "<toolbox>"  # not a call after all
    assert held.end() == ("", [], None)


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server.engine, tiny_server.http, tiny_server.client


ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


def checked(call, tools=TOOLS) -> dict:
    """A returned call's arguments, validated against its tool's schema."""
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def test_a_tool_call_round_trip_streamed_and_not(server):
    engine, _, client = server
    first = client.chat.completions.create(model=engine.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=96, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    checked(call)
    chunks = list(client.chat.completions.create(model=engine.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 max_tokens=96, temperature=0, stream=True))
    streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [(call.function.name,
                                                                            call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
    answer = client.chat.completions.create(model=engine.model, messages=turn, tools=TOOLS, max_tokens=16,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    # the tool result reached the prompt, and the call's arguments are rendered as an object (not JSON text)
    rendered = engine.template.render(template_messages(turn), add_generation_prompt=True, tools=TOOLS)
    assert '<tool_response>\n{"forecast": "sunny"}' in rendered and '"arguments": {"' in rendered


def test_each_tool_choice(server):
    engine, _, client = server
    named = client.chat.completions.create(model=engine.model, messages=ASK, tools=TOOLS, max_tokens=96, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["add"]
    assert set(checked(named.choices[0].message.tool_calls[0])) == {"a", "b"}
    none = client.chat.completions.create(model=engine.model, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=12, temperature=0)
    plain = client.chat.completions.create(model=engine.model, messages=ASK, max_tokens=12, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message == plain.choices[0].message
    auto = client.chat.completions.create(model=engine.model, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length")  # (tiny writes no call on its own)


def test_rt_chat_reads_and_forces_calls(server):
    engine, _, client = server
    rt = engine.rt
    got = rt.chat(ASK, tools=TOOLS, tool_choice="get_weather", max_new_tokens=96)
    (call,) = got.message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and got.message["content"] is None
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOLS[0]["function"]["parameters"])
    served = client.chat.completions.create(model=engine.model, messages=ASK, tools=TOOLS, max_tokens=96,
                                            temperature=0, tool_choice={"type": "function",
                                                                        "function": {"name": "get_weather"}})
    assert served.choices[0].message.tool_calls[0].function.arguments == call["function"]["arguments"]


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]}, "tools[0]"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]}, "tools[0]"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": 5}}}}]},
     "tools[1]"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}}}],
      "tool_choice": "required", "response_format": None}, "tools"),
])
def test_bad_tools_and_choices_are_400_naming_the_field(server, body, param):
    engine, http, client = server
    resp = http.post("/v1/chat/completions", json={"model": engine.model, "messages": ASK, "max_tokens": 4, **body})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.json()
    assert client.chat.completions.create(model=engine.model, messages=ASK, max_tokens=2).choices  # still serving


def test_the_call_grammar_takes_both_formats():
    llguidance = pytest.importorskip("llguidance")
    for xml in (False, True):
        for only in (None, "add"):
            grammar = call_grammar(TOOLS, only, xml)
            assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""


SPECULATE = dict(policy="fixed", drafter="dflash", block=4)


def test_a_session_reads_calls_and_answers_them_exactly(server):
    """Calls as objects (Session.pending_calls), results as `tool` messages (send_tool_results), each
    turn's tokens those of rt.chat over the same messages alone, unspeculated."""
    rt = server[0].rt
    s = rt.session(tools=TOOLS, tool_choice="required")
    list(s.send(ASK[0]["content"], max_new_tokens=96, **SPECULATE))
    (call,) = s.pending_calls
    assert s.history[-1]["content"] is None and s.history[-1]["tool_calls"] == [call.openai()]
    checked_args = json.loads(call.arguments)
    jsonschema.validate(checked_args, dict(tool_functions(TOOLS))[call.name])
    alone = rt.chat(ASK, tools=TOOLS, tool_choice="required", max_new_tokens=96, policy="off")
    assert s.last_turn.tokens == alone.tokens and [c.openai()["function"] for c in alone.calls] == [
        call.openai()["function"]]
    list(s.send_tool_results({call.id: {"forecast": "sunny"}}, tool_choice="auto", max_new_tokens=12, **SPECULATE))
    assert s.history[-2] == {"role": "tool", "tool_call_id": call.id, "name": call.name,
                             "content": '{"forecast": "sunny"}'}
    assert s.last_turn.reused_tokens > 0 and s.pending_calls == []
    plain = rt.chat(s.history[:-1], tools=TOOLS, max_new_tokens=12, policy="off")
    assert s.last_turn.tokens == plain.tokens and s.history[-1]["content"] == plain.message["content"]


def test_a_session_refuses_bad_results_and_choices_leaving_it_as_it_was(server):
    rt = server[0].rt
    with pytest.raises(TurboError) as e:
        rt.session(tools=[{"type": "function"}])
    assert e.value.field == "tools[0]"
    with pytest.raises(TurboError) as e:
        rt.session(tools=TOOLS, tool_choice="nope")
    assert e.value.field == "tool_choice"
    s = rt.session(tools=TOOLS)
    with pytest.raises(TurboError, match="no tool calls to answer"):
        s.send_tool_results(["x"])
    list(s.send(ASK[0]["content"], max_new_tokens=96, tool_choice="add"))
    (call,) = s.pending_calls
    before = [dict(m) for m in s.history]
    for bad, says in [({"call_nope": "x"}, "not a call of the last turn"), ([], "no tool result for"),
                      (["1", "2"], "2 tool results"), ({call.id: object()}, "expected a str or a JSON value"),
                      ("3", "expected a dict")]:
        with pytest.raises(TurboError, match=says):
            s.send_tool_results(bad)
        assert s.history == before
    with pytest.raises(TurboError) as e:
        s.send_tool_results(["3"], tool_choice="sometimes")
    assert e.value.field == "tool_choice" and s.history == before and s.pending_calls == [call]


def test_task_chat_shows_calls_and_takes_typed_results(server, tmp_path):
    """task=chat tools=FILE: the calls shown on stdout, the next line typed their result, the
    answer to it following -- each call the Python session's."""
    rt = server[0].rt
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    lines = [ASK[0]["content"], '{"forecast": "sunny"}']
    run = subprocess.run([sys.executable, "-m", "turbo", "task=chat", "threads=1", "backend=cpu", "max_new_tokens=96",
                          "tools=tools.json", "tool_choice=required"], input="".join(t + "\n" for t in lines),
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    shown = re.findall(r"^\[tool call (call_\w+)\] (\S+) (.*)$", run.stdout, re.M)
    s = rt.session(tools=TOOLS, tool_choice="required")
    list(s.send(lines[0], max_new_tokens=96))
    first = s.pending_calls
    list(s.send_tool_results([lines[1]], max_new_tokens=96))
    assert [(n, a) for _, n, a in shown] == [(c.name, c.arguments) for c in first + s.pending_calls]
    assert "<tool_call>" not in run.stdout and run.stderr.count("[stats]") == 2
    assert f"[tool result for {shown[0][0]}" in run.stderr
    bad = subprocess.run([sys.executable, "-m", "turbo", "task=chat", "threads=1", "tools=missing.json"],
                         input="", capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "tools file" in bad.stderr


def test_tool_choice_none_renders_one_prompt_in_a_session_rt_chat_and_the_server(server, monkeypatch):
    """tool_choice "none" offers no tool in the prompt (README): a session (its own choice, or a
    turn's), rt.chat and the server render the same prompt for the same messages and tools -- the
    one rendered without tools."""
    engine, _, _ = server
    rt = engine.rt
    served = engine.prepare(parse({"model": engine.model, "messages": ASK, "tools": TOOLS, "tool_choice": "none",
                                   "max_tokens": 2}, chat=True)).request.ids
    chatted = rt.chat(ASK, tools=TOOLS, tool_choice="none", max_new_tokens=2).prompt_tokens
    bare = rt.chat(ASK, max_new_tokens=2).prompt_tokens
    streamed: list[list[int]] = []
    stream = rt.stream
    monkeypatch.setattr(rt, "stream", lambda prompt, *a, **k: streamed.append(list(prompt)) or stream(prompt, *a, **k))
    list(rt.session(tools=TOOLS, tool_choice="none").send(ASK[0]["content"], max_new_tokens=2))
    list(rt.session(tools=TOOLS).send(ASK[0]["content"], max_new_tokens=2, tool_choice="none"))
    assert streamed == [served, served] and chatted == served and served == bare

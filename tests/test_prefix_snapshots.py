"""Snapshots where prefixes are shared (docs/serving.md, "Snapshots where prefixes are shared"):
a request's prefill keeps the state at its chat template's boundaries (the system message and
tools, earlier complete turns) and every serve.snapshot_every tokens, so a later request sharing
that prefix prefills only the rest -- and its tokens are those it gets alone, at every speculation
setting, greedy and seeded, under a grammar. On the shipped tiny install (the server in process)."""

from __future__ import annotations

import json

import pytest

from turbo.chat.template import encode
from turbo.chat.turn import Turn, turn_stop_ids
from turbo.errors import TurboError
from turbo.sequence.options import GenerationOptions as G
from turbo.serve.scheduler import Request, Scheduler
from turbo.serve.settings import ServeLimits

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
SPECULATION = {"off": {"policy": "off"}, "ngram": {"policy": "fixed", "block": 4, "drafter": "ngram"},
               "dflash": {"policy": "fixed", "block": 4, "drafter": "dflash"},
               "mtp": {"policy": "fixed", "block": 3, "drafter": "mtp", "rollback": "replay"}}
SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 5}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}


def system(tag: str) -> dict:
    """A long system prompt of its own per test (the module's server keeps its cache across tests)."""
    return {"role": "system", "content": f"[{tag}] You are a terse assistant for travellers. " + " ".join(
        f"Rule {i}: answer about city {i} with care." for i in range(12))}


def ask(tiny_server, messages: list, tools: list | None, sampling: dict, turbo: dict, **extra) -> dict:
    body = {"model": tiny_server.engine.model, "messages": messages, "max_tokens": 12, **sampling,
            "turbo": turbo, **extra}
    if tools is not None:
        body["tools"] = tools
    r = tiny_server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def alone(tiny_server, messages: list, tools: list | None, sampling: dict, turbo: dict, **extra) -> dict:
    """The cold engine's answer: the same request alone through the runtime (no cache)."""
    o = {"max_new_tokens": 12, **sampling, **turbo, **extra}
    return tiny_server.engine.rt.chat(messages, tools=tools, **o).message


def boundary(tiny_server, messages: list, tools: list | None) -> int:
    """The prompt tokens a snapshot kept after `messages` serves: the ids up to the next user
    message's text (its header shared), less the last one (the anchor the kept state goes on from)."""
    rt = tiny_server.engine.rt
    turn = Turn(tiny_server.engine.template, turn_stop_ids(rt.install, rt.tokenizer), tools)
    text = turn.render([*messages, {"role": "user", "content": "NEXT"}], {}, add_generation_prompt=False)
    return len(encode(rt.tokenizer, text[:text.rindex("NEXT")])) - 1


def same(got: dict, want: dict) -> None:
    message = got["choices"][0]["message"]
    assert message.get("content") == want.get("content")
    assert message.get("reasoning_content") == want.get("reasoning_content")
    assert message.get("tool_calls") == want.get("tool_calls")


@pytest.mark.parametrize("sampled", SAMPLING)
@pytest.mark.parametrize("spec", SPECULATION)
def test_a_shared_system_prompt_and_tools_serve_the_next_question(tiny_server, spec, sampled):
    sampling, turbo = SAMPLING[sampled], SPECULATION[spec]
    sys_ = system(f"{spec}-{sampled}")
    first = [sys_, {"role": "user", "content": "What is the weather in Paris?"}]
    second = [sys_, {"role": "user", "content": "Name a museum in Rome."}]
    a = ask(tiny_server, first, TOOLS, sampling, turbo)
    same(a, alone(tiny_server, first, TOOLS, sampling, turbo))
    b = ask(tiny_server, second, TOOLS, sampling, turbo)
    shared = boundary(tiny_server, [sys_], TOOLS)
    assert shared > 100  # (the system prompt and the tools block)
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
    assert b["usage"]["turbo"]["cached_from"] == "tools"
    same(b, alone(tiny_server, second, TOOLS, sampling, turbo))


def test_a_system_prompt_without_tools_is_a_system_boundary(tiny_server):
    sys_ = system("plain")
    ask(tiny_server, [sys_, {"role": "user", "content": "Hi"}], None, SAMPLING["greedy"], SPECULATION["off"])
    second = [sys_, {"role": "user", "content": "Bye"}]
    b = ask(tiny_server, second, None, SAMPLING["greedy"], SPECULATION["off"])
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == boundary(tiny_server, [sys_], None)
    assert b["usage"]["turbo"]["cached_from"] == "system"
    same(b, alone(tiny_server, second, None, SAMPLING["greedy"], SPECULATION["off"]))
    # streamed, the usage chunk says the same (the prompt's own end now: this prompt was served before)
    r = tiny_server.http.post("/v1/chat/completions", json={
        "model": tiny_server.engine.model, "messages": second, "max_tokens": 12, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "turbo": SPECULATION["off"]})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens_details"]["cached_tokens"], usage["turbo"]["cached_from"]) == \
        (usage["prompt_tokens"] - 1, "prompt")


@pytest.mark.parametrize("sampled", SAMPLING)
def test_a_grammar_constrained_question_goes_on_from_the_shared_prefix(tiny_server, sampled):
    sampling, turbo = SAMPLING[sampled], SPECULATION["ngram"]
    sys_ = system(f"grammar-{sampled}")
    ask(tiny_server, [sys_, {"role": "user", "content": "Weather in Oslo?"}], TOOLS, sampling, turbo)
    second = [sys_, {"role": "user", "content": "Which city is the capital of Norway? Answer in JSON."}]
    b = ask(tiny_server, second, TOOLS, sampling, turbo, response_format=SCHEMA)
    assert b["usage"]["turbo"]["cached_from"] == "tools"
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == boundary(tiny_server, [sys_], TOOLS)
    same(b, alone(tiny_server, second, TOOLS, sampling, turbo, response_format=SCHEMA))


@pytest.mark.parametrize("spec", ["off", "dflash"])
def test_an_edited_last_message_reuses_the_earlier_turns(tiny_server, spec):
    turbo, sampling = SPECULATION[spec], SAMPLING["greedy"]
    earlier = [system(f"edit-{spec}"), {"role": "user", "content": "Plan a day in Lisbon."},
               {"role": "assistant", "content": "Morning: Belem. Afternoon: Alfama. Evening: fado."},
               {"role": "user", "content": "And in Porto?"}]
    ask(tiny_server, earlier, None, sampling, turbo)
    edited = earlier[:3] + [{"role": "user", "content": "And in Coimbra, by train?"}]
    b = ask(tiny_server, edited, None, sampling, turbo)
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == boundary(tiny_server, earlier[:3], None)
    assert b["usage"]["turbo"]["cached_from"] == "turn"
    same(b, alone(tiny_server, edited, None, sampling, turbo))


def test_the_metrics_count_the_snapshots(tiny_server):
    sys_ = system("metrics")
    ask(tiny_server, [sys_, {"role": "user", "content": "Hi"}], TOOLS, SAMPLING["greedy"], SPECULATION["off"])
    text = tiny_server.http.get("/metrics").text
    lines = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines()
             if line.startswith("turbo:")}
    model = tiny_server.engine.model
    assert lines[f'turbo:prefix_cache_bytes{{model_name="{model}"}}'] == tiny_server.engine.scheduler.cache.nbytes > 0
    assert lines[f'turbo:prefix_cache_entries{{model_name="{model}"}}'] >= 3  # tools, prompt, answer
    for kind in ("tools", "prompt", "answer"):
        assert lines[f'turbo:prefix_cache_kept_bytes_total{{kind="{kind}",model_name="{model}"}}'] > 0


def long_prompt(rt, n: int, tail: str) -> list[int]:
    ids = rt.encode(" ".join(f"def f{i}(x): return x * {i}" for i in range(200)))[:n]
    return ids + rt.encode(tail)


def drain(sched: Scheduler, req: Request) -> list:
    events = []
    sched.submit(req, events.append)
    while not (events and (isinstance(events[-1], Exception) or events[-1].finish)):
        sched.step()
    assert not isinstance(events[-1], Exception), events[-1]
    return events


@pytest.mark.parametrize("spec", ["off", "dflash"])
def test_snapshot_every_marks_a_long_completion_prompt(tiny_server, spec):
    rt = tiny_server.engine.rt
    sched = Scheduler(rt, ServeLimits(snapshot_every=64, prefill_chunk=48))
    o = G(max_new_tokens=10, **SPECULATION[spec])
    a = long_prompt(rt, 300, "\n# first")
    drain(sched, Request(a, o))
    held = {len(k) - 1 for k in sched.cache.entries}
    assert {64, 128, 192, 256, len(a) - 1} <= held  # each chunk ended at a mark: the state there was kept
    b = long_prompt(rt, 200, "\n# second, another tail")
    events = drain(sched, Request(b, o))
    assert (events[-1].cached_tokens, events[-1].cached_from) == (192, "chunk")
    assert [t for e in events for t in e.tokens] == rt.generate(b, o).tokens
    assert sched.keeper.kept_bytes["chunk"] > 0 and sched.cache.nbytes <= sched.cache.budget


def test_snapshot_every_is_checked_and_zero_turns_it_off(tiny_server):
    with pytest.raises(TurboError, match=r"serve.snapshot_every=-1, expected an integer >= 0"):
        ServeLimits(snapshot_every=-1)
    rt = tiny_server.engine.rt
    sched = Scheduler(rt, ServeLimits(snapshot_every=0, prefill_chunk=48))
    a = long_prompt(rt, 300, "\n# off")
    drain(sched, Request(a, G(max_new_tokens=4, policy="off")))
    assert "chunk" not in sched.keeper.kept_bytes
    assert {len(k) - 1 for k in sched.cache.entries} <= {len(a) - 1, len(a) - 1 + 4}


def test_an_agent_turn_with_tool_results_is_a_boundary(tiny_server):
    """A turn that called a tool ends after the tool's result: the next question, asked anew, goes
    on from there (through the tools block and the call's rendered arguments)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    earlier = [system("agent"), {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
               {"role": "user", "content": "Should I take an umbrella?"}]
    ask(tiny_server, earlier, TOOLS, SAMPLING["greedy"], SPECULATION["ngram"])
    edited = earlier[:4] + [{"role": "user", "content": "What should I wear?"}]
    b = ask(tiny_server, edited, TOOLS, SAMPLING["greedy"], SPECULATION["ngram"])
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == boundary(tiny_server, earlier[:4], TOOLS)
    assert b["usage"]["turbo"]["cached_from"] == "turn"
    same(b, alone(tiny_server, edited, TOOLS, SAMPLING["greedy"], SPECULATION["ngram"]))

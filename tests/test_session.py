"""Chat sessions (turbo/chat/session.py) and rt.chat (turbo/chat/turn.py): every turn's tokens -- and its
speculation counters -- are those a fresh generation over the whole rendered conversation gives,
whatever state the turn went on from (the last turn's, a snapshot, a fresh prefill), whichever
drafter, block and rollback, after edits, and with other generations run between turns."""

from __future__ import annotations

import pytest
from test_mtp import add_mtp, mtp_tensors

import turbo
from turbo.chat.reasoning import split_reasoning
from turbo.chat.template import encode, render
from turbo.drafters import DrafterBase
from turbo.errors import TurboError
from turbo.repack import repack
from turbo.testing import make_checkpoint, make_drafter

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3.5's shape: earlier turns' reasoning is dropped; the generation prompt opens <think>
QWEN35 = """{%- if messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if loop.index0 > ns.last and m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
USER = ["def fib(n):", "Now in C.", "Why is it slow?", "class Stack:", "The quick brown fox"]
COUNTERS = ("rounds", "drafted", "accepted", "rollbacks", "replayed_rows")


def turn(s, events, **opts):
    """Runs a turn and checks it against a fresh generation over the rendered conversation."""
    tokens = [t for e in events for t in e.tokens]
    prompt = s.template.render(s.history[:-1], add_generation_prompt=True, tools=s.tools, **s.template_kwargs)
    stop_ids = tuple(opts.pop("stop_token_ids", ())) + s.stop_ids  # the caller's and the turn's
    fresh = s.rt.generate(encode(s.rt.tokenizer, prompt), stop_token_ids=stop_ids, **opts)
    assert tokens == fresh.tokens == s.last_turn.tokens
    if opts.get("policy") != "adaptive":  # adaptive picks its blocks from measured costs (timing)
        assert [getattr(s.last_turn.stats, c) for c in COUNTERS] == [getattr(fresh.stats, c) for c in COUNTERS]
    assert s.last_turn.prompt_tokens == fresh.stats.prompt_tokens
    return s.last_turn


def conversation(s, blocks, **opts):
    """Five turns, then a retried turn, an edited earlier turn and an edited system prompt."""
    how = []
    for i, text in enumerate(USER):
        how.append(turn(s, s.send(text, block=blocks[i % len(blocks)], **opts), block=blocks[i % len(blocks)],
                        **opts).resumed_from)
    how.append(turn(s, s.retry(block=blocks[-1], **opts), block=blocks[-1], **opts).resumed_from)
    first = 1 if s.system is None else 0
    how.append(turn(s, s.edit(5 - first, "Redo it.", block=blocks[1 % len(blocks)], **opts),
                    block=blocks[1 % len(blocks)], **opts).resumed_from)
    assert len(s.history) == 7 - first and s.history[5 - first]["content"] == "Redo it."
    s.system = "You answer in French."
    how.append(turn(s, s.send("Encore ?", block=blocks[0], **opts), block=blocks[0], **opts).resumed_from)
    return how


@pytest.fixture(scope="module")
def tiny():
    return turbo.open("tiny")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A random Qwen3.5 checkpoint with a random DFlash2 drafter and a random MTP head."""
    tmp = tmp_path_factory.mktemp("qwen")
    model = make_checkpoint(tmp / "hf", 3)
    cfg = model.config
    add_mtp(tmp / "hf", mtp_tensors(cfg, 3))
    drafter = make_drafter(tmp / "drafter", cfg.hidden_size, cfg.vocab_size, [0, cfg.num_hidden_layers - 2], seed=3)
    return turbo.open(repack(tmp / "hf", tmp / "install", drafter=drafter, quiet=True), backend="cpu")


@pytest.mark.parametrize("rollback,blocks", [("checkpoint", (1, 2, 3, 4, 5)), ("replay", (8, 6, 7, 2, 4))])
def test_tiny_dflash_conversation(tiny, rollback, blocks):
    s = tiny.session("You are terse.")  # tiny's own template (Qwen3.5's format)
    how = conversation(s, blocks, max_new_tokens=10, policy="fixed", drafter="dflash", rollback=rollback)
    # a last round cut short by max_new_tokens ran the trunk past the answer: then a snapshot
    assert how[0] == "fresh" and set(how[1:5]) <= {"last turn", "snapshot"}
    assert how[5:] == ["snapshot", "snapshot", "fresh"]  # retry, edit: from a turn's snapshot; a new system


@pytest.mark.parametrize("drafter,rollback,blocks", [
    ("dflash", "checkpoint", (1, 4, 8)), ("dflash", "replay", (2, 3, 7)),
    ("mtp", "checkpoint", (3, 5, 2)), ("mtp", "replay", (6, 1, 8)),
    ("ngram", "checkpoint", (4, 7, 1)), ("ngram", "replay", (5, 8, 3)),
])
def test_qwen35_drops_reasoning_every_drafter(qwen, drafter, rollback, blocks):
    s = qwen.session(template=QWEN35)
    how = conversation(s, blocks, max_new_tokens=12, policy="fixed", drafter=drafter, rollback=rollback)
    # the answers (all reasoning: a random model never closes its <think>) are dropped on re-render
    assert s.history[2] == {"role": "assistant", "content": "", "reasoning_content": s.history[2]["reasoning_content"]}
    assert how[1:] == ["snapshot"] * 6 + ["fresh"]


@pytest.mark.parametrize("policy", ["off", "adaptive"])
def test_qwen35_plain_and_adaptive(qwen, policy):
    s = qwen.session("Be brief.", template=QWEN35, enable_thinking=False)
    conversation(s, (8,), max_new_tokens=12, policy=policy, drafter="ngram")


def test_a_stable_render_prefills_only_the_new_tokens(tiny):
    s = tiny.session("You are terse.", template=CHATML)
    opts = dict(max_new_tokens=8, policy="off")
    held, stable = None, 0
    for text in USER:
        report = turn(s, s.send(text, **opts), **opts)
        ids = encode(tiny.tokenizer, s.template.render(s.history[:-1], add_generation_prompt=True))
        if held is not None and ids[:len(held)] == held:  # the answer re-encodes to its tokens
            stable += 1
            assert report.resumed_from == "last turn" and report.reused_tokens == len(held) - 1
            assert report.prefilled_tokens == len(ids) - len(held)  # only the new tokens
        elif held is not None:  # it re-encodes otherwise: from this turn's snapshot
            assert report.resumed_from == "snapshot" and report.reused_tokens < len(held) - 1 - 8  # before the answer
        assert report.prefilled_tokens == len(ids) - 1 - report.reused_tokens
        held = ids + report.tokens
        assert report.snapshots >= 1 and report.snapshot_bytes > 0
    assert stable >= 2


def test_other_generations_between_turns_change_nothing(tiny):
    opts = dict(max_new_tokens=10, policy="fixed", block=4, drafter="dflash")
    quiet, busy = tiny.session(), tiny.session()
    for text in USER[:3]:
        a = [t for e in quiet.send(text, **opts) for t in e.tokens]
        tiny.generate("Something else entirely, at length.", **opts)
        b = [t for e in busy.send(text, **opts) for t in e.tokens]
        tiny.generate("def other():", **opts)
        assert a == b and quiet.last_turn.stats.accepted == busy.last_turn.stats.accepted


def test_a_turn_left_half_way_is_retried_exactly(tiny):
    s = tiny.session()
    opts = dict(max_new_tokens=10, policy="fixed", block=3, drafter="dflash")
    turn(s, s.send(USER[0], **opts), **opts)
    events = s.send(USER[1], **opts)
    next(events)
    events.close()  # the state ran past the turn's start: only its snapshot serves now
    assert s.history[-1]["role"] == "user"
    assert turn(s, s.retry(**opts), **opts).resumed_from == "snapshot"


def test_sampled_turns_repeat_generate_with_the_seed(tiny):
    s = tiny.session()
    opts = dict(max_new_tokens=10, policy="fixed", block=3, drafter="dflash", temperature=0.8, top_p=0.9)
    for i, text in enumerate(USER[:3]):
        turn(s, s.send(text, seed=i, **opts), seed=i, **opts)


class Echo(DrafterBase):
    """A caller's drafter object: it keeps no snapshots, so each turn is prefilled afresh."""

    def propose(self, anchor, anchor_pos, block):
        return [anchor] * block


def test_a_drafter_object_without_snapshots_runs_every_turn_afresh(qwen):
    s = qwen.session(template=CHATML)
    opts = dict(max_new_tokens=6, policy="fixed", block=2, drafter=Echo())
    for text in USER[:3]:
        assert turn(s, s.send(text, **opts), **opts).resumed_from == "fresh"


def test_a_turn_ended_by_a_stop_token_goes_on_exactly(tiny):
    """A stop token ends a turn inside a speculative block; the next turns are still exactly a
    fresh generation's, and go on from the kept state."""
    s = tiny.session()
    opts = dict(max_new_tokens=12, policy="fixed", drafter="dflash", block=4)
    prompt = encode(tiny.tokenizer, s.template.render([{"role": "user", "content": USER[0]}],
                                                      add_generation_prompt=True))
    stop = tiny.generate(prompt, **opts).tokens[5]  # the answer's sixth token ends it
    events = list(s.send(USER[0], stop_token_ids=[stop], **opts))
    assert events[-1].finish.reason == "stop" and events[-1].finish.matched == stop
    assert turn(s, iter(events), stop_token_ids=[stop], **opts).tokens[-1] == stop
    for text in USER[1:3]:
        assert turn(s, s.send(text, **opts), **opts).resumed_from in ("last turn", "snapshot")


def test_the_torch_step_runs_every_turn_afresh(tmp_path):
    """The torch prefill is not row-equal to its steps: a session there prefills each turn whole,
    and so still gives exactly a fresh generation's tokens."""
    make_checkpoint(tmp_path / "hf", 4)
    rt = turbo.open(repack(tmp_path / "hf", tmp_path / "install", quiet=True), backend="cpu", native=False)
    assert rt.trunk.stepper.name == "torch"
    s = rt.session(template=CHATML)
    opts = dict(max_new_tokens=6, policy="fixed", drafter="ngram", block=3)
    assert [turn(s, s.send(text, **opts), **opts).resumed_from for text in USER[:3]] == ["fresh"] * 3


def test_snapshots_are_bounded(qwen):
    s = qwen.session(template=QWEN35, snapshots=2)
    opts = dict(max_new_tokens=6, policy="fixed", block=3, drafter="mtp")
    for text in USER:
        turn(s, s.send(text, **opts), **opts)
        assert s.last_turn.snapshots <= 2
    turn(s, s.edit(2, "From turn 2.", **opts), **opts)  # older than every snapshot: fresh
    assert s.last_turn.resumed_from == "fresh"


def test_reset_and_refusals(tiny, qwen):
    s = tiny.session("sys", template=CHATML)
    list(s.send("hi", max_new_tokens=3))
    s.reset()
    assert s.history == [{"role": "system", "content": "sys"}]
    with pytest.raises(TurboError, match="nothing to retry"):
        s.retry()
    with pytest.raises(TurboError, match="not a user message"):
        s.edit(0, "x")
    with pytest.raises(TurboError, match="install install: no chat template"):  # (tiny now ships one)
        qwen.session()
    with pytest.raises(TurboError, match="no chat template"):
        qwen.chat([{"role": "user", "content": "hi"}])


def test_chat_splits_reasoning_and_takes_both_kinds_of_keyword(qwen):
    messages = [{"role": "user", "content": "hi"}]
    for thinking in (True, False):
        res = qwen.chat(messages, template=QWEN35, max_new_tokens=6, enable_thinking=thinking)
        prompt = render(QWEN35, messages, add_generation_prompt=True, enable_thinking=thinking)
        assert res.prompt_tokens == encode(qwen.tokenizer, prompt)
        assert res.tokens == qwen.generate(res.prompt_tokens, max_new_tokens=6).tokens
        assert ("reasoning_content" in res.message) == thinking and res.message["role"] == "assistant"


def test_split_reasoning_as_vllm_qwen3():
    assert split_reasoning("<think>a</think>b") == ("a", "b")
    assert split_reasoning("a</think>b") == ("a", "b")  # the prompt opened the <think>
    assert split_reasoning("plain") == (None, "plain")
    assert split_reasoning("cut short", opened=True) == ("cut short", "")
    assert split_reasoning("<think>x</think>") == ("x", "")

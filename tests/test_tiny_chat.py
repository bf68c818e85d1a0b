"""tiny speaks the Qwen3.5 chat format: its template renders as transformers' apply_chat_template
does, a turn stops at <|im_end|>, and speculation on a chat turn lands and is lossless."""

import pytest

import turbo
from turbo.chat.template import encode, install_template
from turbo.store.install import open_install

QUESTIONS = ["What is 7 * 6?", "Explain os.path.join.", "Write a Python function that reverses a list.",
             "Compute ((12 + 5) * 3) - 8."]
CONVERSATIONS = [
    [{"role": "user", "content": QUESTIONS[0]}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[1]}],
    [{"role": "user", "content": QUESTIONS[0]},
     {"role": "assistant", "content": "The answer is 42.", "reasoning_content": "7 * 6 = 42"},
     {"role": "user", "content": QUESTIONS[2]}],
    [{"role": "user", "content": QUESTIONS[3]},
     {"role": "assistant", "content": "<think>\n12 + 5 = 17\n</think>\n\nThe answer is 43."}],
    [{"role": "system", "content": "You answer questions about Python."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": QUESTIONS[1]},
     {"role": "assistant", "content": "It joins paths.", "reasoning_content": "os.path"}],
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def rt():
    return turbo.open("tiny", backend="cpu")


def test_template_renders_as_transformers(rt):
    from transformers import PreTrainedTokenizerFast

    inst = open_install("tiny")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(inst.path / "tokenizer.json"), eos_token="<|endoftext|>")
    hf.chat_template = (inst.path / "chat_template.jinja").read_text()
    ours = install_template(inst)
    for messages in CONVERSATIONS:
        for kw in ({"enable_thinking": True}, {"enable_thinking": False}, {}, {"tools": TOOLS}):
            for prompt in (True, False):
                if prompt and messages[-1]["role"] == "assistant":
                    continue
                text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt, **kw)
                assert ours.render(messages, add_generation_prompt=prompt, **kw) == text, (messages, kw, prompt)
                ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=prompt,
                                             **kw)
                assert encode(rt.tokenizer, text) == ids
    specials = [rt.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>")]
    assert specials == [4096, 4097, 4098, 4099] and inst.arch.vocab == 4100
    assert 4097 in inst.eos_ids and 0 in inst.eos_ids


@pytest.mark.parametrize("question,thinking", [(QUESTIONS[0], True), (QUESTIONS[3], False)])
def test_a_chat_turn_stops_at_im_end(rt, question, thinking):
    messages = [{"role": "user", "content": question}]
    res = rt.chat(messages, max_new_tokens=64, policy="off", enable_thinking=thinking)
    prompt = install_template(rt.install).render(messages, add_generation_prompt=True, enable_thinking=thinking)
    plain = rt.generate(encode(rt.tokenizer, prompt), max_new_tokens=64, policy="off", stop_token_ids=[4097])
    assert plain.finish.reason == "stop" and plain.finish.matched == 4097  # <|im_end|>
    assert res.tokens == plain.tokens and len(res.tokens) < 64
    if thinking:  # the toy reasons a sentence and ends its turn without closing the block: all reasoning
        assert res.message["reasoning_content"].startswith("The question is about")
    else:  # after the empty think block
        assert res.message["content"].startswith("The answer is") and not res.message.get("reasoning_content")


def test_speculation_on_a_chat_turn_lands_and_is_lossless(rt):
    per_round = {}
    for drafter in ("dflash", "mtp"):
        rounds = accepted = 0
        for q in QUESTIONS:
            messages = [{"role": "user", "content": q}]
            off = rt.chat(messages, max_new_tokens=64, policy="off")
            spec = rt.chat(messages, max_new_tokens=64, policy="fixed", block=4, drafter=drafter)
            assert spec.tokens == off.tokens, (q, drafter)
            rounds += spec.stats.rounds
            accepted += spec.stats.accepted
        per_round[drafter] = accepted / rounds
    # measured (deterministic): DFlash2 3.61, MTP 3.06 per round; the drafters before their chat
    # fine-tune gave ~0.8 / ~1.0 on such turns (docs/TRAINING_tiny.md)
    assert per_round["dflash"] > 2.0 and per_round["mtp"] > 2.0, per_round


def test_trunk_fine_tune_grows_the_vocabulary_and_writes_an_install(tmp_path, capsys):
    """One step of `python -m turbo.train tiny --kind trunk` on a chat group and a raw one."""
    import json

    import torch

    from turbo.train.__main__ import main

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": "The answer is 1.",
                                                      "reasoning_content": "1 = 1"}],
                                        "enable_thinking": True}) + "\n" for q in QUESTIONS))
    (tmp_path / "raw.txt").write_text("def f(x):\n    return x + 1\n" * 8)
    template = open_install("tiny").path / "chat_template.jinja"
    base = open_install("tiny")
    args = ["tiny", "--kind", "trunk", "--data", str(chat), str(tmp_path / "raw.txt"), "--chat-template",
            str(template), "--add-tokens", "<|im_end|>", "<tool_call>", "--stop-tokens", "<tool_call>",
            "--steps", "2", "--batch", "2", "--seq-len", "40", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    new = open_install(tmp_path / "out" / "install")
    assert new.arch.vocab == base.arch.vocab + 1  # <|im_end|> was there already
    added = turbo.open(new.path, backend="cpu").tokenizer.token_to_id("<tool_call>")
    assert added == base.arch.vocab and added in new.eos_ids
    rows = new.index.load("trunk.embed_tokens.weight", torch.float32)
    old = base.index.load("trunk.embed_tokens.weight", torch.float32)
    assert (rows[added] - old.mean(0)).norm() < 0.5 * (old - old.mean(0)).norm(dim=1).mean()  # near the mean
    assert new.has_mtp and new.has_dflash and (new.path / "chat_template.jinja").read_text() == template.read_text()
    assert turbo.open(new.path, backend="cpu").generate("def f(x):", max_new_tokens=4, policy="fixed", block=2).tokens
    capsys.readouterr()
    assert main(args[:-2] + ["--stop-tokens", "<nope>", "--out", str(tmp_path / "bad")]) == 2
    assert "--stop-tokens <nope>: not a token" in capsys.readouterr().err

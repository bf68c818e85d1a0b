"""Chat templates: rendering equals transformers' apply_chat_template (text and ids) over 4 templates
x 10 conversations x enable_thinking x add_generation_prompt; repack keeps the template and the
generation config's eos ids, and refuses a template that does not compile."""

import json

import pytest
from tokenizers import Tokenizer

import turbo
from turbo.chat.template import ChatTemplate, encode, install_template, render
from turbo.errors import TurboError
from turbo.repack import repack
from turbo.store.install import open_install
from turbo.store.template_files import read_template
from turbo.testing import make_checkpoint, tiny_tokenizer

# Qwen3.5's shape, written for these tests: tools in the system turn, <think> blocks kept only for
# the assistant turns after the last user query, tool calls and grouped tool responses,
# enable_thinking=false writing an empty think block after the generation prompt.
QWEN_STYLE = """\
{%- if tools %}
<|im_start|>system
{%- if messages[0].role == 'system' %}

{{ messages[0].content }}

{%- endif %}

# Tools
Call functions, their signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>
Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_query=messages | length - 1) %}
{%- for m in messages[::-1] %}
{%- if m.role == 'user' %}
{%- set ns.last_query = messages | length - 1 - loop.index0 %}
{%- break %}
{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- if not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}
{%- elif m.role == 'user' %}
<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}
{%- set content = m.content if m.content is string else '' %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
{%- if not reasoning and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
<|im_start|>assistant
{% if loop.index0 > ns.last_query and reasoning %}
<think>
{{ reasoning }}
</think>

{% endif %}
{{- content }}
{%- for call in m.tool_calls or [] %}
{%- set f = call.function if call.function is defined else call %}

<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}
</tool_call>
{%- endfor %}
<|im_end|>
{% elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
<|im_start|>user
{%- endif %}

<tool_response>
{{ m.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

{% endif %}
{%- endif %}
"""

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

STRICT = """\
{%- for m in messages %}
{%- if m.role == 'system' and not loop.first %}
{{- raise_exception('System message must be first, found one at position ' ~ loop.index0) }}
{%- endif %}
{%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('Unsupported role ' ~ m.role) }}{% endif %}
{{ '<|im_start|>' ~ m.role ~ '\\n' ~ (m.content | trim) ~ '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

SYSTEM_BRANCH = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
{%- set ns = namespace(system=messages[0]['content'], first=1) %}
{%- else %}
{%- set ns = namespace(system='You are a helpful assistant. It is ' ~ strftime_now('%Y') ~ '.', first=0) %}
{%- endif %}
{%- if documents %}
{%- set ns.system = ns.system ~ '\\n\\nDocuments:' %}
{%- for d in documents %}{% set ns.system = ns.system ~ '\\n[' ~ loop.index ~ '] ' ~ d.title ~ ': ' ~ d.text %}
{%- endfor %}
{%- endif %}
<|im_start|>system
{{ ns.system }}<|im_end|>
{% for m in messages[ns.first:] %}
{%- if m.content is not defined or m.content == '' %}{% continue %}{% endif %}
<|im_start|>{{ m.role }}{% if m.thinking is defined %} (thought: {{ m.thinking | length }} chars){% endif %}

{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking %}<think>
{% endif %}{% endif %}"""

TEMPLATES = {"qwen_style": QWEN_STYLE, "chatml": CHATML, "strict": STRICT, "system_branch": SYSTEM_BRANCH}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                                                "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "time_in", "description": "Local time <&> in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
SYSTEM = {"role": "system", "content": "You answer briefly."}


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **more):
    return {"role": "assistant", "content": text, **more}


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# (messages, what goes to render besides them)
CONVERSATIONS = [
    ([user("Hello")], {}),
    ([SYSTEM, user("What is 2 + 2?")], {}),
    ([user("Name a colour."), assistant("Blue.", reasoning_content="Pick one."), user("Another?"),
      assistant("Green.", reasoning_content="Not blue again."), user("One more")], {}),
    ([SYSTEM, user("Count to 3"), assistant("<think>\nEasy.\n</think>\n\n1 2 3"), user("Backwards"),
      assistant("<think>\nReverse it.\n</think>\n\n3 2 1")], {}),
    ([user("héllo wörld — 你好 🙂 ∑x²"), assistant("Ça va? 👍 «ok»"), user("ñ\ttab\nnewline  ")], {}),
    ([user(""), assistant(""), user("still empty?")], {}),
    ([user("Weather in Paris and the time?"),
      assistant(None, tool_calls=[call("get_weather", {"city": "Paris", "unit": "C"}),
                                  call("time_in", '{"city": "Paris"}')]),
      {"role": "tool", "content": '{"temp": 21}'}, {"role": "tool", "content": "14:05"},
      assistant("21 °C at 14:05.", reasoning_content="Both tools answered.")], {"tools": [WEATHER, CLOCK]}),
    ([user("first"), SYSTEM, user("second")], {}),
    ([SYSTEM, user("Is it raining in Oslo?"), assistant(None, tool_calls=[call("get_weather", {"city": "Oslo"})]),
      {"role": "tool", "content": "rain"}], {"tools": [WEATHER]}),
    ([SYSTEM, user("Summarise the documents."), assistant("They are about cats.", reasoning="Read both."),
      user("And the second?")],
     {"documents": [{"title": "Cats", "text": "Cats purr."}, {"title": "More cats", "text": "They nap <a lot>."}]}),
]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def oracles(tmp_path_factory):
    """name -> (transformers' tokenizer, our ChatTemplate read back from its saved files, our Tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    base = tiny_tokenizer(320)
    base.add_special_tokens(SPECIALS)
    out = {}
    for name, source in TEMPLATES.items():
        hf = PreTrainedTokenizerFast(tokenizer_object=base, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     bos_token="<|endoftext|>")
        hf.chat_template = source
        directory = tmp_path_factory.mktemp(name)
        hf.save_pretrained(directory)
        files = read_template(directory)
        assert files.source == source
        ours = ChatTemplate(files.source, files.where, files.special_tokens)
        out[name] = (hf, ours, Tokenizer.from_file(str(directory / "tokenizer.json")))
    return out


@pytest.mark.parametrize("name", TEMPLATES)
def test_render_equals_transformers(oracles, name):
    hf, ours, tok = oracles[name]
    rendered = refused = 0
    for i, (messages, extra) in enumerate(CONVERSATIONS):
        for thinking in (True, False):
            for prompt in (True, False):
                kw = dict(add_generation_prompt=prompt, enable_thinking=thinking, **extra)
                case = (name, i, thinking, prompt)
                try:
                    text = hf.apply_chat_template(messages, tokenize=False, **kw)
                except Exception as e:  # the template refuses this shape: so must we, in one line
                    with pytest.raises(TurboError) as got:
                        ours.render(messages, **kw)
                    assert "\n" not in str(got.value) and str(got.value).startswith(ours.where), case
                    assert " ".join(str(e).split()) in str(got.value), case
                    refused += 1
                    continue
                assert ours.render(messages, **kw) == text, case
                ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
                assert encode(tok, text) == ids, case
                rendered += 1
    assert rendered >= 28  # each template renders most shapes; the refusals are the designed ones
    if name == "strict":
        assert refused == 12  # a system message not first, a tool role


def test_thinking_and_reasoning_dropped(oracles):
    _, ours, tok = oracles["qwen_style"]
    messages = CONVERSATIONS[2][0][:4]
    text = ours.render(messages + [user("again")], add_generation_prompt=True, enable_thinking=False)
    assert "Pick one." not in text and "Not blue again." not in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    last = ours.render(messages, add_generation_prompt=False)
    assert "<think>\nNot blue again.\n</think>" in last and "Pick one." not in last
    ids = encode(tok, text)
    assert tok.token_to_id("<think>") in ids and tok.token_to_id("<|endoftext|>") not in ids


def test_plain_render_and_errors_are_one_line():
    assert render(CHATML, [user("hi")], add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render("{{ x | tojson }}", [user("a")], x={"k": "<é>"}) == '{"k": "<é>"}'
    assert render("{% generation %}{{ messages[0].content }}{% endgeneration %}", [user("a")]) == "a"
    with pytest.raises(TurboError, match=r"^chat template: not a valid Jinja template \(line 2: ") as e:
        render("ok\n{% if %}\n", [user("a")])
    assert "\n" not in str(e.value)
    with pytest.raises(TurboError, match=r"^chat template: refused to render \(System message must be first"):
        render(STRICT, [user("a"), SYSTEM])
    with pytest.raises(TurboError, match="sandbox|unsafe|not safely"):
        render("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [user("a")])
    with pytest.raises(TurboError, match="non-empty list of messages"):
        render(CHATML, [])


# ---- the template travels with the install ----------------------------------------------------


def _checkpoint(tmp_path, name="hf"):
    src = tmp_path / name
    make_checkpoint(src, 0)
    return src


def test_repack_keeps_chat_template_jinja(tmp_path):
    src = _checkpoint(tmp_path)
    (src / "chat_template.jinja").write_text(QWEN_STYLE)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    inst = open_install(repack(src, tmp_path / "inst", quiet=True))
    assert (inst.path / "chat_template.jinja").read_text() == QWEN_STYLE
    assert inst.chat_template == QWEN_STYLE  # the .jinja file wins over tokenizer_config's
    chat = install_template(inst)
    assert chat.special_tokens == {"eos_token": "<|im_end|>"}
    assert chat.render([user("hi")], add_generation_prompt=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("form", ["text", "named"])
def test_repack_keeps_tokenizer_config_template(tmp_path, form):
    src = _checkpoint(tmp_path)
    value = CHATML if form == "text" else [{"name": "tool_use", "template": "{{ tools }}"},
                                           {"name": "default", "template": CHATML}]
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": value}))
    inst = open_install(repack(src, tmp_path / "inst", quiet=True))
    assert inst.chat_template == CHATML


def test_generation_config_eos_ids_join(tmp_path):
    src = _checkpoint(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"eos_token_id": 3}))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 3, 7]}))
    inst = open_install(repack(src, tmp_path / "inst", quiet=True))
    assert inst.arch.eos_token_ids == (3,)  # what generation stops at today is unchanged
    assert inst.eos_ids == (3, 5, 7)
    (inst.path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert open_install(inst.path).eos_ids == (3, 9)


@pytest.mark.parametrize("where, content, match", [
    ("chat_template.jinja", "{% for m in messages %}{{ m.content }}", r"chat_template\.jinja: not a valid Jinja "
                                                                      r"template \(line 1: .*endfor"),
    ("tokenizer_config.json", {"chat_template": "{{ m.content }"}, r"tokenizer_config\.json \(chat_template\): not a "
                                                                   r"valid Jinja template"),
    ("tokenizer_config.json", {"chat_template": [{"name": "tool_use", "template": "x"}]}, "no text named 'default'"),
    ("tokenizer_config.json", {"chat_template": 7}, "expected the template's text"),
    ("generation_config.json", {"eos_token_id": [1, 999]}, r"generation_config\.json: field 'eos_token_id' has 999"),
])
def test_malformed_refused_at_repack_in_one_line(tmp_path, where, content, match):
    src = _checkpoint(tmp_path)
    (src / where).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(TurboError, match=match) as e:
        repack(src, tmp_path / "inst", quiet=True)
    assert "\n" not in str(e.value) and not (tmp_path / "inst").exists()


def test_install_without_template_refuses_chat_and_completes_raw_text(tmp_path):
    src = _checkpoint(tmp_path)
    plain = open_install(repack(src, tmp_path / "plain", quiet=True))
    assert plain.chat_template is None and plain.eos_ids == plain.arch.eos_token_ids
    with pytest.raises(TurboError, match=r"^install plain: no chat template \(") as e:
        install_template(plain)
    assert "\n" not in str(e.value)
    (src / "chat_template.jinja").write_text(CHATML)
    templated = repack(src, tmp_path / "templated", quiet=True)
    prompt = [5, 17, 42, 7, 99]
    a = turbo.open(plain.path, backend="cpu").generate(prompt, max_new_tokens=12, policy="off")
    b = turbo.open(templated, backend="cpu").generate(prompt, max_new_tokens=12, policy="off")
    assert a.tokens == b.tokens and len(a.tokens) == 12

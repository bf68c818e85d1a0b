"""Messages in, an assistant message out: `Runtime.chat` and what a chat session shares with it.

The prompt is the conversation rendered by the install's chat template (turbo/chat/template.py)
or one given as `template=`; the answer's `<think>...</think>` reasoning is split from its content
the way vLLM's Qwen3 reasoning parser splits it (`split_reasoning`). `turn_stop_ids` is the one
place that says which tokens end a turn. Sessions that keep their state: turbo/chat/session.py.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from ..bounded import strict_loads
from .template import ChatTemplate, encode, install_template, template_variables
from ..errors import TurboError
from ..store.install import Install
from ..sequence.options import GENERATION_FIELDS, GenerationOptions
from .tool_calls import ToolCall, check_tools, forced_call, parse_tool_calls, tool_functions
from ..sequence.stats import Stats
from ..vision.runtime import check_placed, message_images

if TYPE_CHECKING:
    from ..engine import Runtime

THINK, END_THINK = "<think>", "</think>"
END_OF_TURN = "<|im_end|>"  # the Qwen / ChatML end-of-turn token
RENDER_ARGS = ("messages", "add_generation_prompt", "tools", "documents")  # the render's own, not template keywords


@dataclass
class ChatResult:
    message: dict[str, Any]  # {"role": "assistant", "content": ..., "reasoning_content": ...}
    tokens: list[int]
    text: str  # the generated text as is (reasoning and all)
    stats: Stats
    prompt_tokens: list[int] = field(default_factory=list)  # the rendered conversation's ids
    calls: list[ToolCall] = field(default_factory=list)  # the answer's tool calls (message["tool_calls"])


def template_for(install: Install, template: str | ChatTemplate | None) -> ChatTemplate:
    """The template a chat renders with: the caller's (its text or a ChatTemplate), else the
    install's (an install without one is refused by name)."""
    if isinstance(template, ChatTemplate):
        return template
    if template is None:
        return install_template(install)
    return ChatTemplate(template, "template argument", install.template_files.special_tokens)


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates take them: an assistant's tool calls with their arguments as
    objects (OpenAI sends them as JSON text; Qwen's templates iterate them), as vLLM passes them."""
    out = []
    for m in messages if isinstance(messages, (list, tuple)) else ():
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if isinstance(calls, list):
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_object_arguments(call: object) -> object:
    f = call.get("function") if isinstance(call, dict) else None
    args = f.get("arguments") if isinstance(f, dict) else None
    if isinstance(args, str):
        try:
            value = strict_loads(args)  # (a client's text: its nesting bounded before the reader recurses)
        except ValueError:
            return call
        if isinstance(value, dict):
            return {**call, "function": {**f, "arguments": value}}
    return call


def split_keywords(kw: dict[str, Any], chat: ChatTemplate) -> tuple[dict[str, Any], dict[str, Any]]:
    """(generation options, template keyword arguments): a GenerationOptions field is an option,
    a variable the template reads (enable_thinking) a template keyword; any other is refused by
    name (`max_tokens=` must not vanish into the template's context)."""
    check_template_kwargs({k: v for k, v in kw.items() if k not in GENERATION_FIELDS}, chat, options_too=True)
    return ({k: v for k, v in kw.items() if k in GENERATION_FIELDS},
            {k: v for k, v in kw.items() if k not in GENERATION_FIELDS})


def check_template_kwargs(kw: dict[str, Any], chat: ChatTemplate, options_too: bool = False) -> None:
    """Every keyword a variable `chat` reads (template_variables) and not one of the render's own
    arguments (RENDER_ARGS), else a refusal naming it (`field`: the keyword). The one rule for
    rt.chat, sessions and the server's chat_template_kwargs: a typo must not vanish into the
    template's context."""
    own = next((k for k in kw if k in RENDER_ARGS), None)
    if own is not None:
        raise TurboError(f"{own}: not a template keyword here (the render's own argument)", field=own)
    variables = template_variables(chat)
    bad = next((k for k in kw if k not in variables), None)
    if bad is not None:
        near = difflib.get_close_matches(bad, [*variables, *(GENERATION_FIELDS if options_too else ())], n=1)
        raise TurboError(f"{bad} is neither a generation option nor a variable {chat.where} reads"
                         + (f" (nearest: {near[0]})" if near else "")
                         + f"; its variables: {', '.join(sorted(variables)) or 'none'}", field=bad)


def turn_stop_ids(install: Install, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The tokens that end an assistant turn: the install's eos ids, and the template's
    end-of-turn token where the vocabulary has it."""
    end = tokenizer.token_to_id(END_OF_TURN)
    return tuple(dict.fromkeys(install.eos_ids + ((end,) if end is not None else ())))


def turn_options(opts: GenerationOptions | None, fields: dict[str, Any], stop_ids: tuple[int, ...]) -> GenerationOptions:
    """The caller's options with the turn's stop tokens added to any they gave."""
    o = (opts if opts is not None else GenerationOptions()).but(**fields)
    return o.but(stop_token_ids=tuple(dict.fromkeys((o.stop_token_ids or ()) + stop_ids)))


def opens_think(prompt: str) -> bool:
    """The generation prompt left a `<think>` open (thinking templates): the answer starts inside it."""
    return prompt.rfind(THINK) > prompt.rfind(END_THINK)


def answer_opens_think(prompt: str, o: GenerationOptions) -> bool:
    """The answer starts inside a `<think>` the prompt opened, unless a response_format holds it:
    then the whole answer is the constrained content (as vLLM's structured output without a
    reasoning parser)."""
    return opens_think(prompt) and o.response_format is None


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) as vLLM's Qwen3 reasoning parser: a `<think>` the model wrote is
    dropped, what comes before the first `</think>` is the reasoning, the rest the content;
    without a `</think>` there is no reasoning -- unless the prompt opened the `<think>`
    (`opened`): then an answer cut before its `</think>` is all reasoning."""
    before, think, after = text.partition(THINK)
    text = after if think else before
    reasoning, end, content = text.partition(END_THINK)
    if end:
        return reasoning, content
    return (text, "") if opened else (None, text)


def assistant_message(tokenizer: Tokenizer, tokens: list[int], stop_ids: tuple[int, ...],
                      opened: bool) -> dict[str, Any]:
    """The turn's message: the tokens up to a trailing end-of-turn token, decoded and split."""
    n = len(tokens)
    while n and tokens[n - 1] in stop_ids:
        n -= 1
    reasoning, content = split_reasoning(tokenizer.decode(tokens[:n], skip_special_tokens=False), opened)
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


TOOL_CHOICES = ("none", "auto", "required")


def check_tool_choice(tools: list | None, tool_choice: str, chat: ChatTemplate | None = None) -> None:
    """The tools well formed (turbo/tool_calls.check_tools: names `chat`'s call format can carry);
    tool_choice none, auto, required (with tools) or one of the tools' names; else refused naming
    the field."""
    check_tools(tools, chat.source if chat is not None else None)
    if tool_choice not in ("none", "auto") and (not tools or tool_choice not in ("required", *tool_functions(tools))):
        raise TurboError(f"tool_choice {tool_choice!r}: expected none, auto, required or one of the tools' names",
                         field="tool_choice")


def call_options(options: GenerationOptions, tools: list | None, tool_choice: str,
                 chat: ChatTemplate) -> GenerationOptions:
    """The options with the call constrained where tool_choice asks for one (required, or a tool's
    name: turbo/chat/tool_calls.py's grammar in the template's format)."""
    check_tool_choice(tools, tool_choice, chat)
    forced = forced_call(tools, tool_choice, chat.source)
    if forced is None:
        return options
    if options.response_format is not None:
        raise TurboError(f"tool_choice {tool_choice!r} and response_format: give one of them", field="tool_choice")
    return options.but(response_format=forced)


def read_calls(message: dict[str, Any], tools: list | None, tool_choice: str) -> list[ToolCall]:
    """The answer's tool calls, moved from message["content"] into message["tool_calls"] (OpenAI's
    shape); a call written malformed stays text, with the reason in message["tool_call_error"]."""
    if not tools or tool_choice == "none":
        return []
    message["content"], calls, why = parse_tool_calls(message["content"], tools)
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    elif why is not None:
        message["tool_call_error"] = why
    return calls


def run_chat(rt: Runtime, messages: list, opts: GenerationOptions | None, tools: list | None,
             documents: list | None, template: str | ChatTemplate | None, kw: dict[str, Any],
             tool_choice: str = "auto") -> ChatResult:
    """`Runtime.chat`: render (with the generation prompt unless add_generation_prompt=False, as
    transformers' apply_chat_template takes it), generate, split the answer."""
    chat = template_for(rt.install, template)
    kw = dict(kw)
    generation_prompt = kw.pop("add_generation_prompt", True)
    if not isinstance(generation_prompt, bool):
        raise TurboError(f"add_generation_prompt is {generation_prompt!r}, expected True or False",
                         field="add_generation_prompt")
    fields, template_kwargs = split_keywords(kw, chat)
    messages = template_messages(messages) if isinstance(messages, (list, tuple)) else messages
    check_tool_choice(tools, tool_choice, chat)
    offered = tools if tool_choice != "none" else None  # (none: the prompt offers no tool, as the server's)
    prompt = chat.render(messages, add_generation_prompt=generation_prompt, tools=offered, documents=documents,
                         **template_kwargs)
    ids, stop_ids = encode(rt.tokenizer, prompt), turn_stop_ids(rt.install, rt.tokenizer)
    images = message_images(messages)  # (turbo/vision: content parts of type image / image_url)
    if images:
        check_placed(rt, ids, images)
    options = call_options(turn_options(opts, fields, stop_ids), tools, tool_choice, chat)
    result = rt.generate(ids, options, images=images or None)
    message = assistant_message(rt.tokenizer, result.tokens, stop_ids, answer_opens_think(prompt, options))
    calls = read_calls(message, tools, tool_choice)
    return ChatResult(message, result.tokens, result.text, result.stats, ids, calls)

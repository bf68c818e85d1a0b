"""One chat turn, as every front builds and reads it: `Turn`. Runtime.chat (`run_chat`), sessions
(turbo/chat/session.py, image_session.py), the server (turbo/serve/worker.py, app.py), the terminal
chat and the TUI all prepare a turn here -- the template's render with the tools offered, the
options (the turn's stop tokens, the call tool_choice forces), whether the answer opens inside a
`<think>` -- and read its answer here: the message with its reasoning split off and its calls
read, the finish reason, or the same as it streams (`AnswerStream`).

The prompt is the conversation rendered by the install's chat template (turbo/chat/template.py)
or one given as `template=`. `turn_stop_ids` is the one place that says which tokens end a turn.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from ..bounded import strict_loads
from ..errors import TurboError
from ..sequence.options import GENERATION_FIELDS, GenerationOptions
from ..sequence.stats import Stats
from ..store.install import Install
from ..vision.runtime import check_placed, message_images
from .reasoning import ReasoningStream, opens_think, split_reasoning
from .runtime import ChatRuntime
from .template import ChatTemplate, encode, install_template, template_variables
from .tool_calls import CallStream, ToolCall, check_tools, forced_call, parse_tool_calls, tool_functions

END_OF_TURN = "<|im_end|>"  # the Qwen / ChatML end-of-turn token
RENDER_ARGS = ("messages", "add_generation_prompt", "tools", "documents")  # the render's own, not template keywords
DEFAULT_OPTIONS = GenerationOptions()
# The earlier complete turns a prompt's boundaries name (`Turn.boundaries`): the last ones only, since a
# conversation's earlier requests named the earlier ones (and each costs a render and an encode)
TURN_BOUNDARIES = 4


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


def check_tool_choice(tools: list | None, tool_choice: str, chat: ChatTemplate | None = None) -> None:
    """The tools well formed (turbo/chat/tool_calls.check_tools: names `chat`'s call format can
    carry, where they are offered: tool_choice none offers none); tool_choice none, auto, required
    (with tools) or one of the tools' names; else refused naming the field."""
    check_tools(tools, chat.source if chat is not None and tool_choice != "none" else None)
    if tool_choice not in ("none", "auto") and (not tools or tool_choice not in ("required", *tool_functions(tools))):
        raise TurboError(f"tool_choice {tool_choice!r}: expected none, auto, required or one of the tools' names",
                         field="tool_choice")


@dataclass
class Turn:
    """One assistant turn over a conversation: `prepare` renders it (the tools offered: none with
    tool_choice "none", as the server's), `ids` and `images` give what the generation runs on,
    `options_of` the turn's options; `answer` / `answer_of` read the whole answer, `stream` reads it
    as it grows, `finish_reason` says why it ended. Its tools and tool_choice are checked here."""

    template: ChatTemplate
    stop_ids: tuple[int, ...]  # what ends the turn (turn_stop_ids), besides the caller's stop_token_ids
    tools: list | None = None  # the tools given
    tool_choice: str = "auto"  # none | auto | required | a tool's name
    prompt: str = ""  # the conversation rendered (prepare)
    messages: list = field(default_factory=list)  # the conversation (prepare)
    options: GenerationOptions | None = None  # the turn's (options_of)
    forced: dict | None = field(init=False, default=None)  # the response_format of the call tool_choice forces

    def __post_init__(self) -> None:
        check_tool_choice(self.tools, self.tool_choice, self.template)
        # required, or a tool's name: the call constrained (turbo/chat/tool_calls.py's grammar, the template's format)
        self.forced = forced_call(self.tools, self.tool_choice, self.template.source)

    @property
    def offered(self) -> list | None:
        """The tools the prompt offers and the answer's calls are read for (tool_choice none: none)."""
        return self.tools if self.tool_choice != "none" else None

    def render(self, messages: list, template_kwargs: dict[str, Any], *, add_generation_prompt: bool = True,
               documents: list | None = None) -> str:
        """`messages` as the template renders them with this turn's tools (a conversation that is not a
        list goes as it is: the template's render refuses it by name)."""
        shown = template_messages(messages) if isinstance(messages, (list, tuple)) else messages
        return self.template.render(shown, add_generation_prompt=add_generation_prompt, tools=self.offered,
                                    documents=documents, **template_kwargs)

    def prepare(self, messages: list, template_kwargs: dict[str, Any], *, add_generation_prompt: bool = True,
                documents: list | None = None) -> str:
        """The turn's prompt: the conversation rendered, with the generation prompt."""
        self.prompt = self.render(messages, template_kwargs, add_generation_prompt=add_generation_prompt,
                                  documents=documents)
        self.messages = messages
        return self.prompt

    def ids(self, tokenizer: Tokenizer) -> list[int]:
        return encode(tokenizer, self.prompt)

    def boundaries(self, tokenizer: Tokenizer, ids: list[int], template_kwargs: dict[str, Any]) -> dict[int, str]:
        """Where the prepared prompt's structure ends a part other requests share, as the part's
        length in its `ids` -> the part's kind: the system message ("system"; "tools" where the
        tools block renders with it) and each of the last TURN_BOUNDARIES earlier complete turns
        ("turn": an assistant's message, with the tool results after it). A part ends where the message after
        it starts: the text two renders (no generation prompt) of the conversation up to that
        message share, the message's content differing between them -- so every message before it
        renders as in the whole prompt (a template may render a last assistant message otherwise:
        with its <think> block), and the next message's header is shared. Encoded, a boundary only
        where those ids are a prefix of `ids`; a prefix the template renders otherwise, or
        refuses, is none."""
        roles = [m.get("role") if isinstance(m, dict) else None for m in self.messages]
        cuts: dict[int, str] = {}
        if roles[:1] == ["system"] and len(roles) > 1 and roles[1] is not None:
            cuts[1] = "tools" if self.offered else "system"
        turns = [k for k in range(1, len(roles))
                 if roles[k - 1] in ("assistant", "tool") and roles[k] not in ("tool", None)]
        cuts.update({k: "turn" for k in turns[-TURN_BOUNDARIES:]})
        found: dict[int, str] = {}
        for k, kind in cuts.items():
            head, after = self.messages[:k], self.messages[k]
            try:
                a, b = (self.render([*head, {**after, "content": text}], template_kwargs, add_generation_prompt=False)
                        for text in ("A", "B"))
            except TurboError:  # (a template that refuses such a conversation: no boundary there)
                continue
            text = a[:len(os.path.commonprefix([a, b]))]
            if not self.prompt.startswith(text):  # (rendered otherwise than in the whole: not encoded)
                continue
            part = encode(tokenizer, text)
            if 0 < len(part) < len(ids) and ids[:len(part)] == part:
                found[len(part)] = kind
        return found

    def images(self, rt: ChatRuntime, ids: list[int]) -> list:
        """The conversation's images (turbo/vision: content parts of type image / image_url), each
        placed by the template in `ids` (else refused)."""
        found = message_images(self.messages)
        if found:
            check_placed(rt, ids, found)
        return found

    def options_of(self, opts: GenerationOptions | None, fields: dict[str, Any],
                   defaults: GenerationOptions = DEFAULT_OPTIONS) -> GenerationOptions:
        """The turn's options: the caller's (`opts`, else `defaults`) with `fields` over them, the
        turn's stop tokens added to any given, and the call tool_choice forces as the response_format
        -- refused beside a response_format the caller gave (one of `defaults`, the server's, gives way)."""
        o = (opts if opts is not None else defaults).but(**fields)
        o = o.but(stop_token_ids=tuple(dict.fromkeys((o.stop_token_ids or ()) + self.stop_ids)))
        if self.forced is not None:
            given = o.response_format if opts is not None else fields.get("response_format")  # (not the defaults')
            if given is not None:
                raise TurboError(f"tool_choice {self.tool_choice!r} and response_format: give one of them",
                                 field="tool_choice")
            o = o.but(response_format=self.forced)
        self.options = o
        return o

    @property
    def opened(self) -> bool:
        """The answer starts inside a `<think>` the prompt opened, unless a response_format holds it:
        then the whole answer is the constrained content (as vLLM's structured output without a
        reasoning parser)."""
        return opens_think(self.prompt) and (self.options is None or self.options.response_format is None)

    def answer(self, text: str) -> tuple[dict[str, Any], list[ToolCall]]:
        """The message (OpenAI's: content, reasoning_content, tool_calls) and the calls of the answer
        `text`; a call written malformed stays text, with the reason in message["tool_call_error"]."""
        reasoning, content = split_reasoning(text, self.opened)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        calls: list[ToolCall] = []
        if self.offered:
            message["content"], calls, why = parse_tool_calls(content, self.offered)
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
            elif why is not None:
                message["tool_call_error"] = why
        return message, calls

    def answer_of(self, tokenizer: Tokenizer, tokens: list[int]) -> tuple[dict[str, Any], list[ToolCall]]:
        """`answer` of the generated tokens, up to a trailing end-of-turn token."""
        n = len(tokens)
        while n and tokens[n - 1] in self.stop_ids:
            n -= 1
        return self.answer(tokenizer.decode(tokens[:n], skip_special_tokens=False))

    @staticmethod
    def finish_reason(reason: str, calls: list) -> str:
        """OpenAI's finish_reason: "tool_calls" where an answer that stopped made calls."""
        return "tool_calls" if calls and reason == "stop" else reason

    def stream(self) -> AnswerStream:
        return AnswerStream(ReasoningStream(self.opened), self.call_stream())

    def call_stream(self) -> CallStream | None:
        """The answer's calls read as it streams (their text held back), or None: no tool offered."""
        return CallStream(self.offered) if self.offered else None


class AnswerStream:
    """A turn's answer read as it streams, as `Turn.answer` reads it whole: `feed` gives what the
    reasoning and the content gained (a call's text held back) and, at the end, the calls; `why`
    says why what looked like calls was not read."""

    def __init__(self, reasoning: ReasoningStream, calls: CallStream | None):
        self.reasoning, self.calls = reasoning, calls
        self.why: str | None = None

    def feed(self, piece: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, the calls: only in the final feed)."""
        think, content = self.reasoning.feed(piece, final)
        made: list[ToolCall] = []
        if self.calls is not None:
            content = self.calls.feed(content)
            if final:
                rest, made, self.why = self.calls.end()
                content += rest
        return think, content, made


def run_chat(rt: ChatRuntime, messages: list, opts: GenerationOptions | None, tools: list | None,
             documents: list | None, template: str | ChatTemplate | None, kw: dict[str, Any],
             tool_choice: str = "auto") -> ChatResult:
    """`Runtime.chat`: render (with the generation prompt unless add_generation_prompt=False, as
    transformers' apply_chat_template takes it), generate, read the answer."""
    chat = template_for(rt.install, template)
    kw = dict(kw)
    generation_prompt = kw.pop("add_generation_prompt", True)
    if not isinstance(generation_prompt, bool):
        raise TurboError(f"add_generation_prompt is {generation_prompt!r}, expected True or False",
                         field="add_generation_prompt")
    fields, template_kwargs = split_keywords(kw, chat)
    turn = Turn(chat, turn_stop_ids(rt.install, rt.tokenizer), tools, tool_choice)
    turn.prepare(messages, template_kwargs, add_generation_prompt=generation_prompt, documents=documents)
    ids = turn.ids(rt.tokenizer)
    images = turn.images(rt, ids)
    result = rt.generate(ids, turn.options_of(opts, fields), images=images or None)
    message, calls = turn.answer_of(rt.tokenizer, result.tokens)
    return ChatResult(message, result.tokens, result.text, result.stats, ids, calls)

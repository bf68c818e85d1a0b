"""OpenAI's requests: a JSON body checked field by field into a `Body` (a bad field is an
`ApiError` naming it, as OpenAI's error object does). Field names as OpenAI's API reference and
vLLM's entrypoints/openai/protocol.py spell them; what turbo adds is the `turbo` object
(policy, block, drafter, rollback, window) and vLLM's `chat_template_kwargs`, `stop_token_ids`,
`ignore_eos`. The responses are responses.py's, the HTTP side app.py's.

The body's checks are JSON's shapes (a number, an integer, a string, a list, an object): the
values' ranges are the option types' (turbo/sequence/options.py: GenerationOptions, check_n,
check_logprobs), which the library and the CLI share, so that a bound is written once and a
request is refused with the words the library uses, naming the field as the request spells it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from ..chat.tool_calls import check_tools, tool_functions
from ..errors import TurboError
from ..sequence.options import GENERATION_FIELDS, MAX_N, check_logprobs, check_n  # noqa: F401 (MAX_N: re-exported)
from .api_error import ApiError  # (re-exported: protocol.ApiError is the name callers know)
from .body import parse_json  # noqa: F401 (re-exported: app.py calls P.parse_json; the front process too)

TURBO_KEYS = ("policy", "block", "drafter", "rollback", "window", "regex", "grammar")
CONSTRAINTS = ("regex", "grammar")  # turbo.regex / turbo.grammar (Lark): a response_format of turbo's kinds
# the GenerationOptions fields a body gives as JSON numbers (their ranges: GenerationOptions)
NUMBERS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
# request fields turbo does not implement: refused unless they hold the value that means "off"
UNSUPPORTED = {"best_of": 1, "echo": False, "suffix": None}
# option names a request spells otherwise: their messages name the request's field instead
RESPELLED = ("max_new_tokens", "logprobs")

T = TypeVar("T")


@dataclass
class Body:
    """A request's fields, checked; `prompt` (completions) or `messages` (chat) is set."""

    model: str
    chat: bool
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)
    tools: list | None = None
    tool_choice: str = "none"  # none | auto | required | a function's name (chat with tools: auto by default)
    max_tokens: int | None = None  # (its range, and the context's room: GenerationOptions, options.fit_context)
    max_tokens_param: str = "max_tokens"  # the field the client used (named in a refusal)
    options: dict = field(default_factory=dict)  # GenerationOptions fields (checked when the options are built)
    logprobs: int | None = None  # None: none; k: each token's logprob and the top k
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices: sequences sharing the prompt's prefill (seeds seed, seed + 1, ... when given)


def param_of(e: TurboError, max_tokens_param: str = "max_tokens", forced: bool = False) -> str | None:
    """The request field a TurboError concerns (its `field`: the option's name) as the request spells it
    (`forced`: the response_format is the grammar of the tools' call, so theirs)."""
    if forced and e.field == "response_format":
        return "tools"
    if e.field == "tool_choice":  # (a forced call beside a response_format)
        return "tool_choice"
    if e.field in ("max_new_tokens", "max_tokens"):
        return max_tokens_param
    if e.field in TURBO_KEYS:
        return f"turbo.{e.field}"
    return e.field if e.field in GENERATION_FIELDS or e.field == "logprobs" else None


def request_error(e: TurboError, param: str | None) -> ApiError:
    """An option type's refusal as a 400 naming `param`; where the request spells the option
    otherwise (max_tokens for max_new_tokens, top_logprobs for logprobs) its message does too."""
    message = str(e)
    if e.field in RESPELLED and param is not None and message.startswith(f"{e.field} "):
        message = param + message[len(e.field):]
    return ApiError(message, param)


def _checked(check: Callable[[Any], T], value: Any, param: str) -> T:
    """`check(value)` (an option type's check), its TurboError a 400 naming `param`."""
    try:
        return check(value)
    except TurboError as e:
        raise request_error(e, param) from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:  # (finite or not: the ranges are the options' to judge)
    return _is_int(v) or isinstance(v, float)


def _int(body: dict, name: str, where: str = "") -> int | None:
    v = body.get(name)
    if v is not None and not _is_int(v):
        raise ApiError(f"{where}{name} is {json.dumps(v)[:200]}, expected an integer", where + name)
    return v


def _kind(body: dict, name: str, types: type | tuple, what: str) -> Any:
    v = body.get(name)
    if v is not None and not isinstance(v, types):
        raise ApiError(f"{name} is {json.dumps(v)[:200]}, expected {what}", name)
    return v


def _flag(body: dict, name: str) -> bool:
    return bool(_kind(body, name, bool, "true or false"))


def _logprobs(body: dict, name: str) -> int | None:
    return _checked(check_logprobs, _int(body, name), name)


def parse(body: dict, chat: bool) -> Body:
    """The checked fields of a /v1/completions (chat False) or /v1/chat/completions body."""
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(f"model is {json.dumps(model)}, expected the model's name (GET /v1/models)", "model")
    b = Body(model=model, chat=chat)
    for name, off in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and v != off and v != {}:
            raise ApiError(f"{name} is {json.dumps(v)[:200]}: not supported by this server "
                           f"(leave it out{'' if off is None else f' or give {json.dumps(off)}'})", name)
    if chat:
        b.messages = _messages(body.get("messages"))
        b.template_kwargs = _kind(body, "chat_template_kwargs", dict, "an object (template keywords)") or {}
        b.tools = _kind(body, "tools", list, "a list of tools (JSON schemas)")
        b.tool_choice = _tool_choice(body.get("tool_choice"), b.tools)
        for name in ("max_completion_tokens", "max_tokens"):
            if body.get(name) is not None:
                b.max_tokens, b.max_tokens_param = _int(body, name), name
                break
        if _flag(body, "logprobs"):
            b.logprobs = _logprobs(body, "top_logprobs") or 0
        elif body.get("top_logprobs") is not None:
            _logprobs(body, "top_logprobs")
            raise ApiError("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        b.prompt = _prompt(body.get("prompt"))
        b.max_tokens = _int(body, "max_tokens")
        b.logprobs = _logprobs(body, "logprobs")
    b.options = _options(body)
    b.n = _checked(check_n, _int(body, "n"), "n") if body.get("n") is not None else 1
    b.stream = _flag(body, "stream")
    opts = _kind(body, "stream_options", dict, "an object")
    if opts:
        b.include_usage = _flag(opts, "include_usage")
    return b


def _tool_choice(choice: Any, tools: list | None) -> str:
    """OpenAI's tool_choice: "none", "auto" (the default with tools), "required", or
    {"type": "function", "function": {"name": NAME}} (NAME returned) of a tool the request offers."""
    try:
        check_tools(tools)
    except TurboError as e:
        raise ApiError(str(e), e.field) from None
    names = list(tool_functions(tools))
    if choice is None:
        return "auto" if tools else "none"
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(
        choice.get("function"), dict) else None
    if choice not in ("none", "auto", "required") and not isinstance(named, str):
        raise ApiError(f"tool_choice is {json.dumps(choice)[:200]}, expected none, auto, required or "
                       "{\"type\": \"function\", \"function\": {\"name\": NAME}}", "tool_choice")
    if choice != "none" and not tools:
        raise ApiError(f"tool_choice {json.dumps(choice)[:100]} needs tools", "tool_choice")
    if named is not None and named not in names:
        raise ApiError(f"tool_choice names {named!r}, not one of the request's tools ({', '.join(names)})",
                       "tool_choice")
    return named if named is not None else choice


def _prompt(p: Any) -> str | list[int]:
    """A str or a list of token ids; a list holding one of them is that one (more are refused)."""
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p):
        return p
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise ApiError(f"prompt is a list of {len(p)} prompts: this server takes one prompt per request", "prompt")
    raise ApiError(f"prompt is {json.dumps(p)[:200]}, expected a non-empty string or a list of token ids", "prompt")


def _messages(messages: Any) -> list[dict]:
    """The messages with their content as text (a list of text parts is joined)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(f"messages is {json.dumps(messages)[:200]}, expected a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"{where} is {json.dumps(m)[:200]}, expected an object with a role", where)
        content = m.get("content")
        if isinstance(content, list):
            content = _parts(content, f"{where}.content")
        elif content is not None and not isinstance(content, str):
            raise ApiError(f"{where}.content is {json.dumps(content)[:200]}, expected a string or content parts",
                           f"{where}.content")
        out.append({**m, "content": content})
    return out


def _parts(parts: list, where: str) -> str | list[dict]:
    """Text parts joined into one string; with image_url parts, the parts (text and image_url,
    in order) for the template to place each image: a data:, file:// or http(s) URL, which
    turbo/serve/images.py reads as the server's settings allow and decodes."""
    out: list[dict] = []
    for j, part in enumerate(parts):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else None
            if not isinstance(url, str):
                raise ApiError(f"{at}.image_url.url: expected {{\"image_url\": {{\"url\": \"data:image/...;base64,...\"}}}}",
                               f"{at}.image_url.url")
            if url.split(":", 1)[0].lower() not in ("data", "file", "http", "https"):
                raise ApiError(f"{at}.image_url.url: {url[:60]!r} is not a data:, file:// or http(s) URL (send the "
                               "image as data:image/...;base64,...)", f"{at}.image_url.url")
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise ApiError(f"{at} is {json.dumps(part)[:200]}: expected a text part ({{\"type\": \"text\", \"text\": "
                           "...}) or an image_url part", at)
    if any(p["type"] == "image_url" for p in out):
        return out
    return "".join(p["text"] for p in out)


def _options(body: dict) -> dict:
    """The GenerationOptions fields a body sets, as JSON shapes; their ranges are checked when the
    options are built (worker.Engine.prepare)."""
    o: dict[str, Any] = {}
    for name in NUMBERS:
        v = body.get(name)
        if v is not None:
            if not _is_number(v):
                raise ApiError(f"{name} is {json.dumps(v)[:200]}, expected a number", name)
            o[name] = v
    for name in ("top_k", "seed"):
        v = body.get(name)
        if name == "top_k" and v == -1:  # vLLM's "no cut"
            v = None
        if v is not None:
            o[name] = _int(body, name)
    stop = body.get("stop")
    if stop is not None:
        if not (isinstance(stop, str) or isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ApiError(f"stop is {json.dumps(stop)[:200]}, expected a string or a list of strings", "stop")
        o["stop"] = stop
    # an empty object or list is the field left out (as OpenAI's clients send them)
    fmt = _kind(body, "response_format", dict, "an object (OpenAI's response_format)")
    if fmt:
        o["response_format"] = fmt  # (its type and schema: turbo/sequence/grammar.py checks and compiles them)
    bias = _kind(body, "logit_bias", dict, "an object of token ids (as strings) to biases")
    if bias:
        o["logit_bias"] = bias
    ids = _kind(body, "stop_token_ids", list, "a list of token ids")
    if ids:
        o["stop_token_ids"] = ids
    if _flag(body, "ignore_eos"):
        o["stop_at_eos"] = False
    ext = _kind(body, "turbo", dict, f"an object of {', '.join(TURBO_KEYS)}") or {}
    for k, v in ext.items():
        if k not in TURBO_KEYS:
            raise ApiError(f"turbo.{k} is not one of {', '.join(TURBO_KEYS)}", f"turbo.{k}")
        if k in ("block", "window"):
            v = _int(ext, k, "turbo.")
        elif v is not None and not isinstance(v, str):
            what = "a pattern" if k in CONSTRAINTS else "a name"
            raise ApiError(f"turbo.{k} is {json.dumps(v)[:200]}, expected {what}", f"turbo.{k}")
        if k in CONSTRAINTS:
            if "response_format" in o:
                raise ApiError(f"turbo.{k} and response_format: give one constraint", f"turbo.{k}")
            o["response_format"] = {"type": k, k: v}
            continue
        o[k] = v
    return o

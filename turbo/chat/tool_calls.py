"""Tool calls: the calls a model writes in its chat template's format, parsed into OpenAI's shape,
and the grammar that makes it write one (tool_choice "required" or a named function).

Two formats are read, as the Qwen family writes them inside `<tool_call>...</tool_call>`:

- Qwen3.5's (and Qwen3-Coder's): `<function=NAME>` then `<parameter=ARG>\nVALUE\n</parameter>` blocks,
  then `</function>`; each value typed by the tool's JSON schema (a string as written, anything
  else read as JSON);
- the JSON-in-tag form of Qwen2.5 / Qwen3 templates: `{"name": NAME, "arguments": {...}}`.

A call that cannot be read (no closing tag, bad JSON, a function the request did not offer) is
not a call: the answer stays text and the reason is returned beside it, never an error. Nor is a
call whose arguments nest past turbo/bounded.py's MAX_NESTING, or hold NaN / Infinity: refused
rather than written as null or a string (which would change the value the model wrote without a
word), so that `arguments` is always strict JSON, as every other client's reader wants it. Both
formats are read in one pass over the text (find from an advancing offset, never a scan again
from each candidate start).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..bounded import NotStrictJson, check_nesting, strict_loads
from ..errors import TurboError, json_shown
from ..sequence.stops import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
XML_FORMAT = "<function="  # a template that writes calls this way says so in its source
FUNCTION_CLOSE = "</function>"
PARAMETER, PARAMETER_CLOSE = "<parameter=", "</parameter>"
_NAME = re.compile(r"[^>\n]*")  # a <function=NAME> / <parameter=NAME>: up to its '>' (a newline: no name)
XML_UNSAFE = "<>\n\r"  # what a name in the XML format cannot hold (its '>' ends the name)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object (OpenAI's form)
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools: Any, template_source: str | None = None) -> None:
    """OpenAI's tools: a list of {"type": "function", "function": {"name": NAME, "parameters": an
    object's JSON schema}}, names unique; else a TurboError naming the tool (field "tools[i]").
    With the template's source: names its call format cannot carry are refused too."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise TurboError(f"tools is {type(tools).__name__}, expected a list of tools", field="tools")
    check_nesting(tools, "tools", "tools")  # (before anything walks them: json_shown, the grammar's json.dumps)
    seen = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        params = f.get("parameters", {}) if isinstance(f, dict) else None
        props = params.get("properties", {}) if isinstance(params, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"] \
                or not isinstance(params, dict) or params.get("type", "object") != "object" \
                or not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise TurboError(f"tools[{i}] is {json_shown(t)}, expected {{\"type\": \"function\", \"function\": "
                             "{\"name\": NAME, \"parameters\": {\"type\": \"object\", \"properties\": "
                             "{NAME: {JSON schema}}}}}", field=f"tools[{i}]")
        if f["name"] in seen:
            raise TurboError(f"tools[{i}] names {f['name']!r} again: each tool's name once", field=f"tools[{i}]")
        seen.add(f["name"])
        if template_source is not None and XML_FORMAT in template_source:
            _check_xml_names(f["name"], props, i)


def _check_xml_names(name: str, props: dict, i: int) -> None:
    """Names the `<function=NAME>` / `<parameter=NAME>` format can write and read back: a '>' ends
    a name early (`a>b` read back as `a` with `b>...` in its value), a newline is no name."""
    for kind, n in (("function", name), *(("parameter", k) for k in props)):
        if not n or n != n.strip() or any(c in n for c in XML_UNSAFE):
            raise TurboError(f"tools[{i}]: the {kind} name {n!r} cannot be written in the template's "
                             f"<{kind}=NAME> calls: expected a name without <, >, a line break or surrounding "
                             "spaces", field=f"tools[{i}]")


def tool_functions(tools: list | None) -> dict[str, dict]:
    """name -> its parameters' JSON schema, for OpenAI's tools ({"type": "function", "function":
    {"name", "parameters"}}) or bare function objects."""
    out = {}
    for t in tools or []:
        f = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            params = f.get("parameters")
            out[f["name"]] = params if isinstance(params, dict) else {"type": "object", "properties": {}}
    return out


def parse_tool_calls(content: str, tools: list | None) -> tuple[str | None, list[ToolCall], str | None]:
    """(the content before the calls, or None when there is none; the calls; why what looked like
    a call was not read, None when it was or when there is none). With a reason, the content is
    the whole text and there are no calls."""
    start = content.find(OPEN)
    if start < 0:
        return content, [], None
    functions = tool_functions(tools)
    bodies, outside, pos = [], [], start
    while (at := content.find(OPEN, pos)) >= 0 and (end := content.find(CLOSE, at + len(OPEN))) >= 0:
        outside.append(content[pos:at])
        bodies.append(content[at + len(OPEN):end])
        pos = end + len(CLOSE)
    outside.append(content[pos:])  # (a <tool_call> without its </tool_call> is here: no later one has one)
    calls = []
    for body in bodies:
        try:
            calls.append(_call(body.strip(), functions))
        except ValueError as e:
            return content, [], f"tool call {len(calls)}: {e}"
    tail = "".join(outside).strip()
    if OPEN in tail or not calls:
        return content, [], f"a {OPEN} without its {CLOSE}"
    if tail:
        return content, [], f"text after the tool calls: {tail[:60]!r}"
    before = content[:start].strip()
    return before or None, calls, None


def _call(body: str, functions: dict[str, dict]) -> ToolCall:
    if body.startswith("{"):
        try:
            value = strict_loads(body)
        except ValueError as e:
            raise ValueError(f"not JSON ({e})") from None
        name = value.get("name") if isinstance(value, dict) else None
        args = value.get("arguments", {}) if isinstance(value, dict) else None
        if isinstance(args, str):
            try:
                args = strict_loads(args)
            except NotStrictJson as e:
                raise ValueError(f"its arguments are not strict JSON ({e})") from None
            except ValueError:
                raise ValueError("its arguments are not a JSON object") from None
    else:
        head = _NAME.match(body, len(XML_FORMAT)) if body.startswith(XML_FORMAT) else None
        if head is None or head.end() == len(XML_FORMAT) or not body.startswith(">", head.end()) \
                or not body.endswith(FUNCTION_CLOSE) or head.end() + 1 > len(body) - len(FUNCTION_CLOSE):
            raise ValueError(f"expected <function=NAME>...</function> or a JSON object, got {body[:60]!r}")
        name = head.group().strip()
        props = functions.get(name, {}).get("properties", {})
        args = _parameters(body[head.end() + 1:len(body) - len(FUNCTION_CLOSE)], props)
    if not isinstance(name, str) or name not in functions:
        raise ValueError(f"{name!r} is not one of the request's tools ({', '.join(functions) or 'none'})")
    if not isinstance(args, dict):
        raise ValueError("its arguments are not a JSON object")
    return ToolCall(name, json.dumps(args, ensure_ascii=False, allow_nan=False))


def _parameters(text: str, props: dict) -> dict[str, Any]:
    """The `<parameter=NAME>\nVALUE\n</parameter>` blocks of a function's body, typed by `props`,
    in one pass: each search starts where the last one ended (an unclosed block ends the reading:
    no later block has a close either)."""
    args, pos = {}, 0
    while (at := text.find(PARAMETER, pos)) >= 0:
        start = at + len(PARAMETER)
        stop = _NAME.match(text, start).end()  # the name's '>', or a newline: no name from here to it
        if stop == len(text):
            break
        if text[stop] == "\n" or stop == start:  # (a later start before this newline stops at it too)
            pos = stop if text[stop] == "\n" else start
            continue
        value = stop + 1 + text.startswith("\n", stop + 1)
        close = text.find(PARAMETER_CLOSE, value)
        if close < 0:
            break
        name = text[start:stop].strip()
        args[name] = _typed(text[value:close - 1 if close > value and text[close - 1] == "\n" else close],
                            props.get(name, {}))
        pos = close + len(PARAMETER_CLOSE)
    return args


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: strings as written, anything else read as JSON
    (a value that does not read stays the text; one too deep or not finite refuses the call)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return value
    try:
        return strict_loads(value)
    except NotStrictJson as e:
        raise ValueError(f"a value is not strict JSON ({e})") from None
    except ValueError:
        return value


def tool_messages(calls: list[ToolCall], results: Any) -> list[dict[str, Any]]:
    """The `tool` messages answering `calls`: `results` maps each call's id to its result, or lists
    them in the calls' order; a result is a str (a JSON value is sent as its JSON text)."""
    if isinstance(results, dict):
        unknown = next((k for k in results if k not in {c.id for c in calls}), None)
        if unknown is not None:
            raise TurboError(f"tool result for {unknown!r}: not a call of the last turn "
                             f"({', '.join(c.id for c in calls)})")
        missing = [c.id for c in calls if c.id not in results]
        values = [results.get(c.id) for c in calls]
    elif isinstance(results, (list, tuple)):
        missing = [c.id for c in calls[len(results):]]
        if len(results) > len(calls):
            raise TurboError(f"{len(results)} tool results for the last turn's {len(calls)} calls")
        values = list(results)
    else:
        raise TurboError(f"tool results of type {type(results).__name__}: expected a dict (call id -> result) "
                         "or a list in the calls' order")
    if missing:
        raise TurboError(f"no tool result for {', '.join(missing)}: every call of the last turn needs one")
    out = []
    for c, v in zip(calls, values):
        if not isinstance(v, str):
            check_nesting(v, f"tool result for {c.id}", "results")  # (json.dumps recurses)
            try:
                v = json.dumps(v, ensure_ascii=False)
            except (TypeError, ValueError):
                raise TurboError(f"tool result for {c.id} of type {type(v).__name__}: expected a str or a JSON "
                                 "value") from None
        out.append({"role": "tool", "tool_call_id": c.id, "name": c.name, "content": v})
    return out


# a parameter's value in the XML form, by its schema's type (a string or anything else: any text without a tag)
VALUE_PATTERNS = {"integer": r"-?[0-9]{1,18}", "number": r"-?[0-9]{1,18}(\.[0-9]{1,18})?", "boolean": r"true|false"}


def forced_call(tools: list | None, tool_choice: str, template_source: str) -> dict | None:
    """The response_format that makes the answer one call in the template's format (tool_choice
    "required": any of the tools; a tool's name: that one), or None (none, auto)."""
    if tool_choice in ("none", "auto"):
        return None
    only = None if tool_choice == "required" else tool_choice
    return {"type": "grammar", "grammar": call_grammar(tools, only, XML_FORMAT in template_source)}


def call_grammar(tools: list | None, only: str | None, xml: bool) -> str:
    """A Lark grammar (llguidance's) for one tool call in the template's format: any of the tools
    (tool_choice "required"), or `only` (a named function). JSON is compact and its arguments hold
    to the tool's schema; XML values to their parameter's type."""
    functions = tool_functions(tools)
    names = [only] if only is not None else list(functions)
    alts, values = [], {}
    for name in names:
        params = functions[name]
        if xml:
            props = params.get("properties", {}) if isinstance(params, dict) else {}
            parts = []
            for k, spec in props.items():
                kind = spec.get("type") if isinstance(spec, dict) else None
                values.setdefault(kind, f"VALUE{len(values)}")
                opens, closes = lark_literal(PARAMETER + k + ">\n"), lark_literal("\n" + PARAMETER_CLOSE + "\n")
                parts.append(f"({opens} {values[kind]} {closes})?")
            head = lark_literal(XML_FORMAT + name + ">\n")
            alts.append(f'{head} {" ".join(parts)} "{FUNCTION_CLOSE}"')
        else:
            schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False,
                      "x-guidance": {"whitespace_flexible": False}}
            alts.append("%json " + json.dumps(schema))
    rules = "\n".join(f"call{i}: {a}" for i, a in enumerate(alts))
    terminals = "\n".join(f"{t}: /{VALUE_PATTERNS.get(kind, '[^<]*')}/" for kind, t in values.items())
    return f'start: "{OPEN}\\n" ({" | ".join(f"call{i}" for i in range(len(alts)))}) "\\n{CLOSE}"\n{rules}\n{terminals}\n'


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal (llguidance reads JSON's escapes): a name is never grammar."""
    return json.dumps(text, ensure_ascii=False)


class CallStream:
    """A streamed answer's content with its tool calls held back: `feed` gives the content to send
    now (never a piece of a call, nor what may begin one), `end` the rest and the calls. Linear in
    the answer: only the text not sent yet is searched, and the pieces are joined once, at the end."""

    def __init__(self, tools: list | None):
        self.tools, self.pieces, self.unsent, self.sent, self.inside = tools, [], "", 0, False

    def feed(self, piece: str) -> str:
        self.pieces.append(piece)
        if self.inside:
            return ""
        self.unsent += piece  # (what may begin a call, and the new piece: short)
        at = self.unsent.find(OPEN)
        end = at if at >= 0 else len(self.unsent) - held_back(self.unsent, (OPEN,))
        self.inside = at >= 0
        out, self.unsent = self.unsent[:end], self.unsent[end:]
        self.sent += len(out)
        return out

    def end(self) -> tuple[str, list[ToolCall], str | None]:
        """(the content not sent yet, the calls, why what looked like calls was not read)."""
        text = "".join(self.pieces)
        _, calls, why = parse_tool_calls(text, self.tools)
        return ("", calls, None) if calls else (text[self.sent:], [], why)

"""A checkpoint's chat template: found in its files, compiled and rendered as transformers does.

`render` turns messages into the prompt text `tokenizer.apply_chat_template(..., tokenize=False)`
gives for the same template and arguments (transformers' utils/chat_template_utils.py is the
reference: the sandboxed environment, its helpers, how messages are prepared); `encode` turns that
text into the ids `apply_chat_template(tokenize=True)` gives. `read_template` / `generation_eos_ids`
read what an install (or a checkpoint, at repack) carries; `install_template` is what chat asks for.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import string
import threading
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..bounded import MAX_NESTING, check_nesting
from ..errors import TurboError, checked_text, one_line
from ..store.arch import show
from ..store.template_files import TEMPLATE_FILE, TOKENIZER_CONFIG, generation_eos_ids, read_template

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ..store.install import Install

# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
# Where transformers finds a message's reasoning; the first name is the one templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What a template may raise while rendering: a Jinja error, raise_exception's, or Python's own
# errors from an operation on the wrong type (`'a' + 1`, a missing index).
RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                 ZeroDivisionError, OverflowError, RecursionError)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A template's text, where it came from (for messages) and the special tokens it is given."""

    source: str
    where: str = "chat template"
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def render(self, messages: list, /, *, add_generation_prompt: bool = False, tools: list | None = None,
               documents: list | None = None, **template_kwargs: Any) -> str:
        """The prompt text for `messages`; keyword arguments (enable_thinking=...) go to the
        template and override a special token of the same name, as in transformers. (`self` and
        `messages` are positional-only, so a template keyword of that name is a keyword, not a
        TypeError.)"""
        template = compile_template(self.source, self.where)
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise TurboError(f"{self.where}: tools must be JSON schemas (dicts), got {show(tools)}")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise TurboError(f"{self.where}: documents must be dicts (title, text), got {show(documents)}")
        if "messages" in template_kwargs:
            raise TurboError(f"{self.where}: messages is the messages, not a template keyword")
        messages = _drop_none(messages, self.where)
        # what plain() and the template walk by recursion: its nesting bounded first, by a loop
        data = (("messages", messages), ("tools", tools), ("documents", documents), *template_kwargs.items())
        for name, value in data:
            check_nesting(value, name, name, RENDER_NESTING)
        chat = _alias_reasoning(plain(messages))
        kwargs = plain({**self.special_tokens, **template_kwargs})
        # one dict, not keywords: Jinja's own render(self, ...) would take a `self` keyword as itself
        context = {**kwargs, "messages": chat, "tools": plain(tools), "documents": plain(documents),
                   "add_generation_prompt": add_generation_prompt}
        _bounds.deadline, out, size = time.monotonic() + RENDER_SECONDS, [], 0
        try:
            for piece in template.generate(context):  # the output counted as it grows
                size += len(piece)
                if size > RENDER_CHARS:
                    raise RenderLimit(f"its output passed {RENDER_CHARS} characters")
                out.append(piece)
            _tick()
        except RenderLimit as e:
            raise TurboError(f"{self.where}: refused to render: {e} (a template's render is bounded to "
                             f"{RENDER_SECONDS:g} s and {RENDER_CHARS} characters)") from None
        except MemoryError:
            raise TurboError(f"{self.where}: refused to render: it ran out of memory") from None
        except RENDER_ERRORS as e:
            raise TurboError(f"{self.where}: refused to render ({one_line(e)})") from None
        finally:
            _bounds.deadline = None
        return "".join(out)


def render(template: str | ChatTemplate, messages: list, /, *, add_generation_prompt: bool = False,
           tools: list | None = None, documents: list | None = None, **template_kwargs: Any) -> str:
    """`template` (its text, or a ChatTemplate with its special tokens) rendered over `messages`."""
    chat = template if isinstance(template, ChatTemplate) else ChatTemplate(template)
    return chat.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, documents=documents,
                       **template_kwargs)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """A rendered prompt's ids: the template wrote every special token itself, none is added."""
    return tokenizer.encode(checked_text(text, "chat prompt"), add_special_tokens=False).ids


def install_template(install: Install) -> ChatTemplate:
    """The install's template, or a refusal naming the install (raw completion needs none)."""
    files = install.template_files
    if files.source is None:
        raise TurboError(f"install {install.name}: no chat template (neither {TEMPLATE_FILE} nor a chat_template in "
                         f"{TOKENIZER_CONFIG}); it completes raw text only")
    return ChatTemplate(files.source, files.where, files.special_tokens)


# ---- compiling -------------------------------------------------------------------------------


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which a prompt must not get
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` for templates without the type itself (its attributes are a way out of the sandbox)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace refusing underscore names, as transformers' (no way to CPython internals)."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_' ({name!r})")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


# ---- bounds: a template is code from a checkpoint or a client's server; its render must end --------

RENDER_SECONDS = 10.0  # a render's time (a real template over a long conversation: milliseconds)
RENDER_CHARS = 32 << 20  # the rendered text, and any one string a template builds on the way
# what a template's data may nest: messages hold values each nested up to MAX_NESTING (a call's
# arguments, a tool's result) a few levels down; far below Python's recursion limit either way
RENDER_NESTING = 2 * MAX_NESTING
_bounds = threading.local()  # this thread's render deadline (servers render on several threads at once)


class RenderLimit(Exception):
    """A render past RENDER_SECONDS or RENDER_CHARS (refused in one line by `ChatTemplate.render`)."""


def _tick() -> None:
    deadline = getattr(_bounds, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise RenderLimit(f"it ran past {RENDER_SECONDS:g} s")


def _sized(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > RENDER_CHARS:
        raise RenderLimit(f"it built a value of {len(value)} items, over the {RENDER_CHARS} limit")
    return value


def _check_args(args: tuple, kwargs: dict) -> None:
    """An integer argument past RENDER_CHARS (`'x'|center(10**10)`, `s.ljust(...)`) is refused
    before the call allocates it."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > RENDER_CHARS:
            raise RenderLimit(f"an argument of {a} is over the {RENDER_CHARS} limit")


def _bounded_loop(iterable: Any):
    """What every {% for %} iterates: the same items, the deadline checked on each (nested loops
    over short lists make billions of iterations with no call and no output)."""
    for item in iterable:
        _tick()
        yield item


def _bounded_concat(items: list) -> str:
    parts = [str(x) for x in items]
    if sum(map(len, parts)) > RENDER_CHARS:
        raise RenderLimit(f"a ~ concatenation is over the {RENDER_CHARS} character limit")
    return "".join(parts)


# Filters whose work is C code's over their input, whatever its size (a long conversation's text
# goes through trim, replace, tojson...). Every other filter loops in Python over the items or words
# of its input (wordwrap, title, sort, groupby, map, join with an attribute...): microseconds each,
# and one call cannot be stopped at the deadline, so their input is bounded to FILTER_ITEMS (at most
# seconds of work); striptags rebuilds its input at each tag it removes (quadratic): less.
C_SPEED_FILTERS = frozenset(["abs", "attr", "capitalize", "center", "count", "d", "default", "e", "escape",
                             "filesizeformat", "first", "float", "forceescape", "format", "int", "items", "last",
                             "length", "list", "lower", "random", "replace", "reverse", "round", "safe", "string",
                             "tojson", "trim", "truncate", "upper", "wordcount"])
FILTER_ITEMS = 1 << 20
FILTER_LIMITS = {"striptags": 1 << 16}  # (65,536 characters of tags: 0.05 s; 1M: 10 s)


def _bounded_filter(f, name: str):
    @functools.wraps(f)  # (keeps Jinja's pass_context / pass_eval_context marks)
    def bounded(*args, **kwargs):
        _tick()
        _check_args(args, kwargs)
        if name not in C_SPEED_FILTERS:
            limit = FILTER_LIMITS.get(name, FILTER_ITEMS)
            big = next((a for a in args if isinstance(a, (str, list, tuple, dict, range)) and len(a) > limit), None)
            if big is not None:
                raise RenderLimit(f"the {name} filter over {len(big)} items is over its limit of {limit}")
        return _sized(f(*args, **kwargs))
    return bounded


# A printf conversion's flags, width and precision (`%0999999999d` builds a 1 GB string from one `%`)
_PRINTF_SPEC = re.compile(r"[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_PARENS = re.compile(r"[()]")
_DIGITS = re.compile(r"\d+")


def _check_width(digits: str | None) -> None:
    # (compared as text first: int() refuses a run of more than 4300 digits)
    if digits and digits != "*" and (len(digits) > len(str(RENDER_CHARS)) or int(digits) > RENDER_CHARS):
        raise RenderLimit(f"a format width or precision of {digits[:20]} is over the {RENDER_CHARS} limit")


def _check_printf(fmt: str, args: Any) -> None:
    """`fmt % args` (the `%` operator, the format filter): each conversion's width and precision,
    and a `*` one's integer argument, at most RENDER_CHARS, before the string is built. One pass
    from '%' to '%' (a regex tried at each '%' would rescan `%(((...` to the end every time)."""
    starred, pos = False, fmt.find("%")
    while pos >= 0:
        pos += 1
        if fmt.startswith("(", pos):  # a mapping key, to its matching ')' (Python counts nested ones)
            depth = 0
            for paren in _PARENS.finditer(fmt, pos):
                depth += 1 if paren.group() == "(" else -1
                if depth == 0:
                    pos = paren.end()
                    break
            else:
                return  # (no end to the key: Python refuses the format itself)
        spec = _PRINTF_SPEC.match(fmt, pos)
        _check_width(spec.group(1))
        _check_width(spec.group(2))
        starred = starred or "*" in spec.group()
        pos = fmt.find("%", spec.end() + 1)  # past the conversion's type (the second '%' of '%%')
    if starred:  # (only then is an integer argument a width: '%d' % 10**10 is a number to print)
        _check_args(args if isinstance(args, tuple) else (args,), {})


def _check_str_format(fmt: str, values: tuple) -> None:
    """`fmt.format(*values)`: each field's format spec's numbers at most RENDER_CHARS (a nested
    field, `{:{}}`, takes them from the values: their digits are checked too)."""
    for _, _, spec, _ in string.Formatter().parse(fmt):
        for digits in _DIGITS.findall(spec or ""):
            _check_width(digits)
        if spec and "{" in spec:
            _check_args(values, {})
            for v in values:
                for digits in _DIGITS.findall(v if isinstance(v, str) else ""):
                    _check_width(digits)


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    """Jinja's format filter (`value % args`), its widths bounded first."""
    _check_printf(str(value), kwargs or args)
    return jinja2.filters.do_format(value, *args, **kwargs)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with every loop, call, filter, `+`, `*`, `**` and `~` bounded in time and size:
    no template can render for ever or build a string past RENDER_CHARS (a MemoryError, or swap)."""

    intercepted_binops = frozenset(["+", "*", "**", "%"])

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "%" and isinstance(left, str):
            _check_printf(left, right)
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64 and abs(left) > 1:
            raise RenderLimit(f"{left!r} ** {right!r} is over the limit of an exponent of 64")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > RENDER_CHARS:
                    raise RenderLimit(f"a repetition of {len(seq)} x {n} is over the {RENDER_CHARS} limit")
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if len(left) + len(right) > RENDER_CHARS:
                raise RenderLimit(f"a + of {len(left)} and {len(right)} items is over the {RENDER_CHARS} limit")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        _tick()
        _check_args(args, kwargs)
        if getattr(__obj, "__name__", None) == "replace" and isinstance(getattr(__obj, "__self__", None), str) \
                and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            text = __obj.__self__  # the result's length is known before it is built
            if len(text) + (text.count(args[0]) if args[0] else len(text) + 1) * len(args[1]) > RENDER_CHARS:
                raise RenderLimit(f"a replace() is over the {RENDER_CHARS} character limit")
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any):
        """str.format / format_map as the sandbox wraps them, their widths bounded first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        @functools.wraps(wrapped)
        def bounded(*args, **kwargs):
            mapping = args[0] if value.__name__ == "format_map" and args and isinstance(args[0], Mapping) else {}
            _check_str_format(value.__self__, (*args, *kwargs.values(), *mapping.values()))
            return wrapped(*args, **kwargs)
        return bounded

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Filter(loop.iter, "_bounded_loop", [], [], None, None).set_lineno(loop.lineno)
        for node in list(tree.find_all(jinja2.nodes.Concat)):  # a ~ b ~ c: through a bounded join
            node.__class__ = jinja2.nodes.Filter  # (in place: the parent keeps its reference)
            items = jinja2.nodes.List(node.nodes, lineno=node.lineno)
            del node.nodes
            node.node, node.name, node.args, node.kwargs, node.dyn_args, node.dyn_kwargs = (
                items, "_bounded_concat", [], [], None, None)
        return tree


@lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters.update(tojson=_tojson, format=_format)
    env.filters.update({k: _bounded_filter(f, k) for k, f in env.filters.items()})
    env.filters.update(_bounded_loop=_bounded_loop, _bounded_concat=_bounded_concat)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(source)


@lru_cache(maxsize=16)
def _variables(source: str) -> frozenset[str]:
    return frozenset(jinja2.meta.find_undeclared_variables(_compiled(source).environment.parse(source)))


def template_variables(chat: ChatTemplate) -> frozenset[str]:
    """The names a template reads from its context (Jinja's undeclared variables: enable_thinking,
    tools, bos_token...) and the special tokens it is given: what a template keyword may be."""
    compile_template(chat.source, chat.where)  # (refused in one line if it does not compile)
    return _variables(chat.source) | frozenset(chat.special_tokens)


def compile_template(source: str, where: str = "chat template") -> jinja2.Template:
    """The compiled template, or a refusal naming it with Jinja's message and line."""
    if not isinstance(source, str):
        raise TurboError(f"{where}: expected the template's text, got {show(source)}")
    try:
        return _compiled(source)
    except jinja2.TemplateSyntaxError as e:
        raise TurboError(f"{where}: not a valid Jinja template (line {e.lineno}: {one_line(e)})") from None
    except (jinja2.TemplateError, RecursionError) as e:
        raise TurboError(f"{where}: not a valid Jinja template ({one_line(e)})") from None


# ---- the data a template sees (as transformers prepares it) -----------------------------------


def _drop_none(messages: list, where: str) -> list[dict]:
    """Messages as dicts without their None values (`content=None` would render as "None")."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TurboError(f"{where}: expected a non-empty list of messages, got {show(messages)}")
    out = []
    for i, m in enumerate(messages):
        if dataclasses.is_dataclass(m) and not isinstance(m, type):
            m = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        if not isinstance(m, Mapping):
            raise TurboError(f"{where}: a message must be a dict (role, content), got {show(m)}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list, tuple)):  # (bytes, a set: "<bytes>")
            raise TurboError(f"messages[{i}].content is of type {type(content).__name__}: expected a str or a "
                             "list of content parts", field=f"messages[{i}].content")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types: the sandbox knows nothing of other objects' methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # a subclass (an enum, a numpy float) back to its base type
        if isinstance(value, base):
            return {str: str.__str__, int: int.__int__, float: float.__float__}[base](value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        return plain(value.item())  # a numpy scalar: np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """A message's reasoning under every name templates read it by (`thinking` first, as transformers)."""
    out = []
    for m in chat:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def check_checkpoint(directory: Path, vocab: int) -> None:
    """What repack refuses before writing: a template that does not compile, eos ids out of range."""
    files = read_template(directory)
    if files.source is not None:
        compile_template(files.source, files.where)
    generation_eos_ids(directory, vocab)

"""Constrained decoding: the output held to any JSON object, a JSON schema, a regex or a Lark
grammar (OpenAI's `response_format`, turbo's `regex` / `grammar` kinds), through llguidance
(the `grammar` extra; it takes all four, compiles a schema in milliseconds, and its matcher
rolls back, which a speculative round needs).

The mask is applied where every other processing is (turbo/sequence/penalties.py): row i of a verify is
masked with the grammar's state after the committed tokens and the proposals before it, so greedy
output is the unspeculated constrained output token for token and sampled output follows the masked
distribution exactly. Proposals the grammar forbids are cut before the verify (they could never be
accepted). The grammar's end lets only the generation's stop tokens through.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from ..errors import TurboError, json_shown
from ..extras import require
from .grammar_bounds import check_lark, check_size, schema_text

KINDS = ("text", "json_object", "json_schema", "regex", "grammar")
COMPILED_KEPT = 64  # grammars kept compiled per runtime (LRU)
T = TypeVar("T")
COMPILED_BYTES = 64 << 20  # and their text's bytes at most: a schema near the body limit compiles to megabytes
# llguidance vocabularies kept, one per set of stop ids (LRU): each is a copy of the vocabulary's trie
# (3.2 MiB on tiny's 4,100 ids), and a client names the set (stop_token_ids): kept all, 300 requests
# each with its own grew the engine by 960 MiB (scripts/rss_grammar.py)
VOCABS_KEPT = 4
# JSON as json.dumps writes it: no whitespace a model could repeat for ever between tokens
COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must be: kind json_object | json_schema | regex | grammar (Lark), and its source."""

    kind: str
    source: str = ""  # the schema as JSON text, the regex, the Lark grammar

    @staticmethod
    def parse(value: object) -> ResponseFormat | None:
        """OpenAI's response_format ({"type": "json_object"}, {"type": "json_schema", "json_schema":
        {"schema": {...}}}, {"type": "text"}) or turbo's ({"type": "regex", "regex": "..."},
        {"type": "grammar", "grammar": "LARK"}), or a ResponseFormat; None: unconstrained."""
        if value is None or isinstance(value, ResponseFormat):
            return None if value is None or value.kind == "text" else value
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in KINDS:
            raise TurboError(f"response_format is {json_shown(value)}, expected {{\"type\": one of {', '.join(KINDS)}}}",
                             field="response_format")
        if kind == "text":
            return None
        if kind == "json_object":
            return ResponseFormat(kind)
        if kind == "json_schema":
            spec = value.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise TurboError("response_format.json_schema.schema: expected a JSON schema object",
                                 field="response_format")
            return ResponseFormat(kind, schema_text(schema, "response_format.json_schema.schema"))
        source = value.get(kind)
        if not isinstance(source, str) or not source:
            raise TurboError(f"response_format.{kind}: expected a non-empty string", field="response_format")
        # measured before llguidance sees it: a deep enough grammar overflows its stack (grammar_bounds.py)
        (check_lark if kind == "grammar" else check_size)(source, f"response_format.{kind}")
        return ResponseFormat(kind, source)


class Kept(OrderedDict):
    """A cache bounded in entries and in bytes (by `size`), dropping the least recently used."""

    def __init__(self, most: int, most_bytes: int | None = None, size: Callable[[Any], int] = lambda v: 0):
        super().__init__()
        self.most, self.most_bytes, self.size, self.bytes = most, most_bytes, size, 0

    def used(self, key: Hashable) -> Any | None:
        """The entry (now the most recently used), or None."""
        if key not in self:
            return None
        self.move_to_end(key)
        return self[key]

    def keep(self, key: Hashable, value: Any) -> Any:
        self[key] = value
        self.bytes += self.size(value)
        while len(self) > self.most or (self.most_bytes is not None and self.bytes > self.most_bytes and len(self) > 1):
            self.bytes -= self.size(self.popitem(last=False)[1])
        return value


class Grammars:
    """A runtime's grammars: its vocabulary for llguidance (one per set of stop tokens) and the
    grammars compiled from response formats, both kept LRU."""

    def __init__(self, tokenizer_json: str, vocab: int):
        self.tokenizer_json, self.vocab = tokenizer_json, vocab
        self.tokenizers = Kept(VOCABS_KEPT)  # stop ids -> llguidance's LLTokenizer
        self.compiled = Kept(COMPILED_KEPT, COMPILED_BYTES, len)  # ResponseFormat -> the grammar's text

    def _tokenizer(self, stops: tuple[int, ...]) -> Any:
        if (kept := self.tokenizers.used(stops)) is not None:
            return kept
        llg = require("llguidance", "grammar")
        try:
            return self.tokenizers.keep(stops, llg.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab,
                                                               eos_token=list(stops)))
        except ValueError as e:  # (a tokenizer whose tokens' bytes llguidance cannot tell)
            raise TurboError(f"response_format: llguidance cannot read this install's tokenizer.json "
                             f"({str(e).splitlines()[0][:200]})", field="response_format") from None

    def grammar(self, fmt: ResponseFormat, stops: tuple[int, ...]) -> str:
        """The format compiled (once) and checked: a TurboError naming response_format when it is not a
        grammar llguidance takes."""
        if (kept := self.compiled.used(fmt)) is not None:
            return kept
        llg = require("llguidance", "grammar")
        m = llg.LLMatcher
        try:
            text = {"json_object": lambda: m.grammar_from_json_schema({"type": "object"}, overrides=COMPACT),
                    "json_schema": lambda: m.grammar_from_json_schema(fmt.source, overrides=COMPACT),
                    "regex": lambda: m.grammar_from_regex(fmt.source),
                    "grammar": lambda: m.grammar_from_lark(fmt.source)}[fmt.kind]()
        except ValueError as e:
            raise TurboError(f"response_format ({fmt.kind}): {first_line(str(e))}", field="response_format") from None
        tokenizer = self._tokenizer(stops)
        error = on_compiler_stack(lambda: m.validate_grammar(text, tokenizer))
        if error:
            raise TurboError(f"response_format ({fmt.kind}): {first_line(error)}", field="response_format")
        return self.compiled.keep(fmt, text)

    def state(self, fmt: ResponseFormat, stops: tuple[int, ...]) -> GrammarState:
        """A sequence's matcher, at the start of its output."""
        if not stops:
            raise TurboError("response_format: a constrained generation ends at a stop token, and this one has none "
                             "(keep stop_at_eos, or give stop_token_ids)", field="response_format")
        llg = require("llguidance", "grammar")
        tokenizer, text = self._tokenizer(stops), self.grammar(fmt, stops)
        matcher = on_compiler_stack(lambda: llg.LLMatcher(tokenizer, text, log_level=0))  # (it compiles the grammar)
        if not matcher.is_error():
            matcher.compute_bitmask()  # (a language with no string in it is found at its first mask)
        if matcher.is_error():
            raise TurboError(f"response_format ({fmt.kind}): no output satisfies it "
                             f"({first_line(matcher.get_error())})", field="response_format")
        return GrammarState(matcher, self.vocab)


# llguidance's compiler recurses: grammar_bounds.py's bounds sit 4x under the depths that crashed it
# on 8 MiB of stack, Linux's usual for a thread; under `ulimit -s unlimited` a thread gets 2 MiB, and
# one within the bounds crashed. So it compiles on a thread of this much stack, whatever the caller's.
COMPILER_STACK = 64 << 20  # bytes (reserved, not touched until used)
_stack_size = threading.Lock()  # (threading.stack_size is the process's: set only around our thread's start)


def on_compiler_stack(work: Callable[[], T]) -> T:
    """`work()` on a thread of COMPILER_STACK bytes of stack: its value, or what it raised."""
    out: list = []

    def run() -> None:
        try:
            out.append((True, work()))
        except BaseException as e:  # (re-raised in the caller's thread)
            out.append((False, e))

    with _stack_size:
        before = threading.stack_size(COMPILER_STACK)
        try:
            thread = threading.Thread(target=run, name="turbo-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(before)
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def first_line(error: str) -> str:
    """llguidance's error in one line: its first, and the line below that says why where there is
    one (a regex's `error: unclosed character class`, under the regex and its caret)."""
    lines = error.splitlines() or [""]
    why = next((line.strip()[len("error:"):].strip() for line in lines[1:] if line.strip().startswith("error:")), "")
    return f"{lines[0][:200]} {why[:200]}" if why else lines[0][:300]


class GrammarState:
    """One sequence's grammar: its matcher as the committed tokens left it."""

    def __init__(self, matcher: Any, vocab: int):
        self.matcher, self.vocab = matcher, vocab

    def allowed_prefix(self, proposals: list[int]) -> int:
        """How many of a round's proposals the grammar lets through, in order."""
        return self.matcher.validate_tokens(proposals) if proposals else 0

    def allowed(self) -> torch.Tensor:
        """The next token's mask [vocab] (True: allowed)."""
        mask = self.matcher.compute_bitmask()
        if self.matcher.is_error():
            raise self.failed("its parser stopped")
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[:self.vocab].astype(bool))

    def failed(self, what: str) -> TurboError:
        """The generation ends: the grammar could not go on (a parser limit, a language whose
        strings never end); one line naming response_format."""
        return TurboError(f"response_format: {what} ({first_line(self.matcher.get_error())})",
                          field="response_format")

    def rows(self, logits: torch.Tensor, proposals: list[int]) -> torch.Tensor:
        """The masked logits of a round's rows (every proposal allowed: `allowed_prefix` cut them),
        row i with the state after proposals[:i]; the matcher is left as it was."""
        out = logits.float().clone()
        consumed = 0
        for i in range(out.shape[0]):
            out[i].masked_fill_(~self.allowed().to(out.device), float("-inf"))
            if i < len(proposals) and i < out.shape[0] - 1:
                if not self.matcher.consume_token(proposals[i]):
                    raise self.failed(f"the grammar refused proposal {i} after letting it through")
                consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        return out

    def commit(self, tokens: list[int]) -> None:
        for t in tokens:
            if self.matcher.is_stopped():
                return  # (the stop token that ends the output)
            if not self.matcher.consume_token(t):
                raise self.failed(f"the grammar refused output token {t}")

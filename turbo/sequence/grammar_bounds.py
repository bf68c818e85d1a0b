"""What llguidance is given, measured before it compiles it: its compiler recurses over a schema's
nesting and `$ref`s and over a Lark grammar's chains of rules, and a deep enough one overflows
its stack (SIGSEGV: the process goes, not an exception). Measured on llguidance 1.9.1 with 8 MiB
of stack (a thread's the same), the first depth that crashed:

- JSON schema, in nodes along its longest path (`longest_path` of `schema_graph`): 2,542 for a
  chain of `$ref`s, 1,956 for `$ref`s through arrays nested 30 deep (the soonest), 2,800-4,100
  through objects, anyOf, allOf and prefixItems;
- Lark, in `check_lark`'s weight: about 2,690 for chained rules (`r0: r1`), 3,438 for rules each with a
  group, 4,402 for rules each with ten nested groups. A `%json` body compiles apart: a chain of
  1,500 rules ending in a schema 1,000 deep compiled.

MAX_DEPTH is 3.9 times under the first, MAX_LARK_WEIGHT 2.7 times under the second; both far
above a real schema or grammar (an OpenAI strict schema nests at most 10 deep). And llguidance
compiles on a thread of 64 MiB of stack (grammar.on_compiler_stack), 8 times the stack measured
on, whatever the caller's thread has (2 MiB under `ulimit -s unlimited`, where a schema within
the bounds crashed it). A refusal is one line naming the field; nothing here recurses.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote, urljoin

from ..errors import TurboError, ascii_decimal, json_shown

MAX_BYTES = 512 * 1024  # a schema of 5,000 properties (OpenAI's most) is 144 KB, and compiles in 3 s
MAX_NESTING = 128  # objects and arrays inside each other: serde_json's limit (llguidance's parser)
MAX_NODES = 50_000  # objects and arrays in a schema (a Python value shared in it counts each time)
MAX_DEPTH = 500  # nodes on a schema's longest path through its nesting and $refs
MAX_LARK_WEIGHT = 1000  # a Lark grammar's ':', '(' and '[': its rules and groups, however chained
REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
JSON_BODY = re.compile(r"%json\s*")  # llguidance's Lark: `%json {schema}` inlines a JSON schema


def refused(what: str, why: str) -> TurboError:
    return TurboError(f"{what}: {why}", field="response_format")


def check_size(source: str, what: str) -> None:
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise refused(what, f"{size} bytes, expected at most {MAX_BYTES // 1024} KiB")


def schema_text(schema: object, what: str) -> str:
    """`schema` as the JSON text llguidance is given, once its size, nesting and depth through
    its $refs are within the bounds."""
    edges = schema_graph(schema, what)
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise refused(what, f"not JSON ({e})") from None
    check_size(text, what)
    depth = longest_path(edges)
    if depth > MAX_DEPTH:
        raise refused(what, f"{depth} subschemas deep through its nesting and $refs, expected at most {MAX_DEPTH} "
                            "(a deeper one overflows llguidance's stack)")
    return text


def schema_graph(schema: object, what: str) -> list[list[int]]:
    """The schema's objects and arrays as a graph: for each, the nodes it holds and the one its
    $ref names. A $ref is resolved as JSON Schema does (against the base URI its $ids make, to a
    JSON pointer or an $anchor); one that names nothing in the schema is refused (llguidance
    fetches nothing either)."""
    nodes: list[Any] = []
    edges: list[list[int]] = []
    at: dict[int, int] = {}  # id(a node's value) -> its first node
    resources: dict[str, int] = {"": 0}  # base URI -> the node whose $id made it
    anchors: dict[tuple[str, str], int] = {}
    refs: list[tuple[int, str, str]] = []  # (node, its base URI, the $ref)
    todo: list[tuple[object, int, int, str]] = [(schema, -1, 1, "")]  # (value, parent node, nesting, base URI)
    while todo:
        value, parent, nesting, base = todo.pop()
        if not isinstance(value, (dict, list)):
            continue
        if nesting > MAX_NESTING:
            raise refused(what, f"nested over {MAX_NESTING} deep (objects and arrays), expected at most {MAX_NESTING}")
        if len(nodes) == MAX_NODES:
            raise refused(what, f"over {MAX_NODES} objects and arrays, expected at most {MAX_NODES}")
        i = len(nodes)
        nodes.append(value)
        edges.append([])
        at.setdefault(id(value), i)
        if parent >= 0:
            edges[parent].append(i)
        if isinstance(value, dict):
            if isinstance(value.get("$id"), str):
                base = urljoin(base, value["$id"]).partition("#")[0]
                resources.setdefault(base, i)
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(value.get(key), str):
                    anchors.setdefault((base, value[key]), i)
            refs += [(i, base, value[key]) for key in REF_KEYS if isinstance(value.get(key), str)]
        todo += [(v, i, nesting + 1, base) for v in (value.values() if isinstance(value, dict) else value)]
    for i, base, ref in refs:
        # (urljoin leaves a fragment alone under a scheme it does not know, as "urn:": joined by hand)
        uri, _, fragment = (base + ref if ref.startswith("#") else urljoin(base, ref)).partition("#")
        target = resolve(nodes, resources.get(uri), fragment, anchors.get((uri, fragment)))
        if target is None or id(target) not in at:
            raise refused(what, f"$ref {json_shown(ref)} names nothing in the schema (one outside it is not followed)")
        edges[i].append(at[id(target)])
    return edges


def resolve(nodes: list[Any], resource: int | None, fragment: str, anchor: int | None) -> object:
    """What a $ref's fragment names in its resource: the resource itself, a JSON pointer's
    value, or an $anchor's node; None: nothing."""
    if resource is None:
        return None
    if not fragment.startswith("/"):
        return nodes[resource] if not fragment else None if anchor is None else nodes[anchor]
    value: object = nodes[resource]
    for part in fragment[1:].split("/"):
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and (k := ascii_decimal(key, 9)) is not None and k < len(value):
            value = value[k]
        else:
            return None
    return value


def longest_path(edges: list[list[int]]) -> int:
    """The most nodes on a path along `edges`, each cycle's nodes all counted (its strongly
    connected component's size: no path that visits a node once can pass more of them), so a
    bound on the stack of any compiler that walks the graph and stops at a node it is inside.
    Tarjan's algorithm, iteratively: a component is complete only after every one it reaches."""
    n = len(edges)
    index, low, component = [-1] * n, [0] * n, [-1] * n
    on_stack = [False] * n
    stack: list[int] = []
    depth: list[int] = []  # per component: the most nodes on a path from it
    counter = 0
    for root in range(n):
        if index[root] >= 0:
            continue
        work = [(root, 0)]
        while work:
            v, k = work[-1]
            if k == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            if k < len(edges[v]):
                work[-1] = (v, k + 1)
                w = edges[v][k]
                if index[w] < 0:
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                members = []
                while not members or members[-1] != v:
                    members.append(stack.pop())
                    on_stack[members[-1]] = False
                    component[members[-1]] = len(depth)
                after = max((depth[component[w]] for m in members for w in edges[m]
                             if component[w] != len(depth)), default=0)
                depth.append(len(members) + after)
    return max(depth, default=0)


def check_lark(source: str, what: str) -> None:
    """A Lark grammar within the bounds: its size, its weight (every ':' a rule's definition
    needs and every '(' and '[' a group opens, outside its `%json` bodies: however its rules
    chain, no chain is longer), and each `%json` body as a schema."""
    check_size(source, what)
    rest, start = [], 0
    for m in JSON_BODY.finditer(source):
        if m.start() < start:
            continue
        try:
            schema, end = json.JSONDecoder().raw_decode(source, m.end())
        except (ValueError, RecursionError):
            raise refused(what, f"the %json at character {m.start()} is not followed by JSON") from None
        schema_text(schema, f"{what} (its %json at character {m.start()})")
        rest.append(source[start:m.start()])
        start = end
    rest.append(source[start:])
    weight = sum(part.count(":") + part.count("(") + part.count("[") for part in rest)
    if weight > MAX_LARK_WEIGHT:
        raise refused(what, f"{weight} rules and groups (its ':', '(' and '['), expected at most {MAX_LARK_WEIGHT} "
                            "(a deeper grammar overflows llguidance's stack)")

"""scripts/fuzz.py's input classes: the server's request bodies and GGUF tensor tables.

    python -m scripts.fuzz --bodies N [--seed S]    # N bodies against the app in process (tiny)
    python -m scripts.fuzz --gguf N [--seed S]      # N GGUF tables, repacked in process

--bodies mutates good completions / chat bodies (each class below) and posts each to the app over
one worker.Engine on tiny (fastapi's TestClient, serve.max_body_mb=1); after every 50 cases, and
at the end, the unmutated request is sent again and must give the reference text. Outcomes:

    error-4xx           a 4xx whose body is exactly OpenAI's error object                 ok
    served              a 200 for a body that is a valid request                         ok
    served-equal        a 200 with the reference text (a mutation that changes nothing)   ok
    served-changed      a 200 whose text is not the reference's for a no-op mutation     BAD
    error-5xx           a 5xx                                                            BAD
    error-malformed     a 4xx without OpenAI's error object                              BAD
    accepted-should-refuse  a 200 for a body no valid request is                         BAD
    other-exception     the app raised out of the client                                 BAD

--gguf mutates the tensor table (or a metadata value) of a small Q8_0 GGUF (a random Qwen3.5
written by turbo.testing.gguf_writer) and repacks it. Outcomes: turbo_error (one line),
repacked-equal (the unmutated file's model.safetensors, byte for byte: a no-op class),
accepted-should-refuse / repacked-changed / other-exception (BAD).
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import shutil
import tempfile
from pathlib import Path

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
GOOD = [
    ("/v1/completions", {"model": "tiny", "prompt": "def fib(n):", "max_tokens": 6, "temperature": 0}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Write a haiku."}],
                              "max_tokens": 6, "temperature": 0}),
]
WEIRD_STRINGS = ["\udcff", "\ud800x", "a\x00b", "\x1b[2J", "\u202e", "💥" * 3, "", " " * 10, "{{ 7*7 }}", "%s%n"]
PY_NAMES = ["self", "cls", "source", "template", "messages", "kwargs", "args", "__class__", "__init__",
            "add_generation_prompt", "tools", "documents", "globals", "range", "namespace", "loop", "super"]
NOOP_BODY = ("noop-unknown-field", "noop-reorder", "noop-whitespace")
# classes whose every case is no valid request (a 200 is a finding)
REFUSE_BODY = ("drop-required", "wrong-type", "huge-int", "deep-nesting", "lone-surrogate", "bad-json",
               "oversize", "bad-parts", "nan-number")


def _walk(body, rng: random.Random) -> tuple[list, object]:
    """A random (path, value) inside `body`: path a list of keys / indices."""
    path, node = [], body
    while isinstance(node, (dict, list)) and node and rng.random() < 0.6:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    return path, node


def _set(body, path: list, value) -> None:
    node = body
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


def _leaf_paths(body, prefix=()) -> list[tuple]:
    out = []
    if isinstance(body, dict):
        for k, v in body.items():
            out += _leaf_paths(v, prefix + (k,)) or [prefix + (k,)]
    elif isinstance(body, list):
        for i, v in enumerate(body):
            out += _leaf_paths(v, prefix + (i,)) or [prefix + (i,)]
    return out


def body_case(cls: str, rng: random.Random) -> tuple[str, bytes]:
    route, good = rng.choice(GOOD)
    body = copy.deepcopy(good)
    dumps = lambda b: json.dumps(b).encode()  # noqa: E731 (ensure_ascii: a lone surrogate goes out as \\udcff)
    if cls == "drop-required":
        del body["model" if rng.random() < 0.5 else ("prompt" if "prompt" in body else "messages")]
    elif cls == "wrong-type":
        path = list(rng.choice(_leaf_paths(body)))
        if path[-1] == "max_tokens" or path[-1] == "temperature":
            value = rng.choice(["6", [6], {"n": 6}, True, None if path[-1] == "temperature" else -1])
            if value is None:
                value = "hot"
        else:
            value = rng.choice([3, 2.5, True, {"x": 1}, [1, "a"]])
        _set(body, path, value)
    elif cls == "huge-int":
        name = rng.choice(["max_tokens", "seed", "top_k", "logprobs" if "prompt" in body else "top_logprobs"])
        # (a top_k past the vocab is no cut, and -1 vLLM's "no cut": both valid)
        body[name] = rng.choice([-5, -10**30] if name == "top_k" else [10**30, -10**30, 2**64, -5, 10**400])
        if "top_logprobs" in body:
            body["logprobs"] = True
    elif cls == "deep-nesting":
        depth = rng.choice([65, 100, 500, 900, 5000])  # (written as text: json.dumps recurses)
        opens = [rng.choice(("[", '{"a": ')) for _ in range(depth)]
        deep = "".join(opens) + '"x"' + "".join("]" if o == "[" else "}" for o in reversed(opens))
        where = rng.choice(["user", "extra", "turbo", "chat_template_kwargs", "messages"])
        if where == "messages" and "messages" in body:
            body["messages"][0]["extra"] = "@@DEEP@@"
        else:
            body[where] = "@@DEEP@@"
        return route, dumps(body).replace(b'"@@DEEP@@"', deep.encode())
    elif cls == "lone-surrogate":
        path = list(rng.choice(_leaf_paths(body)))
        s = rng.choice(["\udcff", "\ud800", "a\udfffb"])
        if rng.random() < 0.3:
            body[s] = 1  # in a key
        else:
            _set(body, path, s)
    elif cls == "bad-json":
        raw = dumps(body)
        cut = rng.randrange(1, len(raw) - 1)
        return route, rng.choice([raw[:cut], raw[:cut] + b"\xff\xfe" + raw[cut:], b"\xef\xbb\xbf" + raw[:cut],
                                  raw.replace(b"{", b"[", 1), b"null", b"1e999999", b'"' * 3])
    elif cls == "oversize":
        pad = "x" * rng.choice([(1 << 20) + 1, 3 << 20])
        body["prompt" if "prompt" in body else "user"] = pad
    elif cls == "bad-parts":
        body = copy.deepcopy(GOOD[1][1])
        route = GOOD[1][0]
        body["messages"][0]["content"] = [rng.choice([
            {"type": "image_url", "image_url": {"url": "file:///tmp/a\x00b.png"}},
            {"type": "image_url", "image_url": {"url": "file:///dev/zero"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}},
            {"type": "image_url", "image_url": "not-an-object"},
            {"type": "text", "text": 5}, {"type": "audio", "audio": "x"}, "text", None, [],
        ])]
    elif cls == "nan-number":
        body[rng.choice(["temperature", "top_p", "min_p"])] = float(rng.choice(["nan", "inf", "-inf"]))
        return route, json.dumps(body).encode()  # (Python writes NaN / Infinity: what a sloppy client sends)
    elif cls == "weird-strings":  # valid requests: served (their text is the model's business)
        body["prompt" if "prompt" in body else "messages"] = (
            rng.choice(WEIRD_STRINGS[2:]) or "x" if "prompt" in body
            else [{"role": "user", "content": rng.choice(WEIRD_STRINGS[2:])}])
        if "prompt" in body and not body["prompt"]:
            body["prompt"] = "x"
    elif cls == "template-kwargs":
        body = copy.deepcopy(GOOD[1][1])
        route = GOOD[1][0]
        body["chat_template_kwargs"] = {rng.choice(PY_NAMES): rng.choice([1, "x", None, [1], {"a": 1}])}
    elif cls == "noop-unknown-field":
        body[rng.choice(["user", "metadata", "x_unknown"])] = rng.choice(["u", {"k": "v"}, 1])
    elif cls == "noop-reorder":
        body = dict(reversed(list(body.items())))
    elif cls == "noop-whitespace":
        return route, json.dumps(body, indent=rng.choice([0, 1, 4])).encode() + b"\n\t "
    return route, dumps(body)


BODY_CLASSES = [*REFUSE_BODY, "weird-strings", "template-kwargs", *NOOP_BODY]


def _text(route: str, r: dict) -> str:
    c = r["choices"][0]
    return c["text"] if route.endswith("/completions") and "text" in c else c["message"]["content"]


def run_bodies(n: int, seed: int) -> list[tuple[str, str, str]]:
    """(class, outcome, detail) for n body cases against the app over tiny, in process."""
    from fastapi.testclient import TestClient

    from turbo.sequence.options import GenerationOptions, OpenOptions
    from turbo.serve.app import make_app
    from turbo.serve.settings import ServeConfig
    from turbo.serve.worker import Engine

    tmp = Path(tempfile.mkdtemp(prefix="turbo-fuzz-bodies-"))
    try:
        (tmp / "chatml.jinja").write_text(CHATML)
        config = ServeConfig(chat_template=str(tmp / "chatml.jinja"), max_body_mb=1.0, image_dirs=(str(tmp),))
        engine = Engine("tiny", OpenOptions(backend="cpu", threads=1), GenerationOptions(), config)
        engine.start()
        client = TestClient(make_app(engine), raise_server_exceptions=False)
        post = lambda route, raw: client.post(route, content=raw, headers={"content-type": "application/json"})  # noqa: E731
        want = {route: _text(route, post(route, json.dumps(b).encode()).json()) for route, b in GOOD}
        rng, out = random.Random(seed), []
        for i in range(n):
            cls = BODY_CLASSES[i % len(BODY_CLASSES)]
            route, raw = body_case(cls, rng)
            try:
                r = post(route, raw)
            except Exception as e:  # noqa: BLE001 (the finding)
                out.append((cls, "other-exception", f"{type(e).__name__}: {e}"))
                continue
            out.append((cls, *_judge(cls, route, r, want)))
            if i % 50 == 49 or i == n - 1:  # still serving, with unchanged answers
                for route, b in GOOD:
                    r = post(route, json.dumps(b).encode())
                    if r.status_code != 200 or _text(route, r.json()) != want[route]:
                        out.append(("still-serving", "served-changed", f"{r.status_code} {r.text[:200]}"))
        engine.stop()
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _judge(cls: str, route: str, r, want: dict) -> tuple[str, str]:
    if r.status_code >= 500:
        return "error-5xx", r.text[:200]
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
            ok = set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) \
                and err["message"] and "\n" not in err["message"]
        except (ValueError, KeyError, TypeError):
            ok = False
        return ("error-4xx", "") if ok else ("error-malformed", r.text[:200])
    if cls in REFUSE_BODY:
        return "accepted-should-refuse", r.text[:200]
    if cls in NOOP_BODY:
        return ("served-equal", "") if _text(route, r.json()) == want[route] else ("served-changed", r.text[:200])
    return "served", ""


# ---- GGUF tensor tables ---------------------------------------------------------------------------

GGUF_REFUSE = ("offset-misaligned", "offset-overlap", "offset-past-end", "offset-gap", "type-changed",
               "dim-changed", "dim-zero", "dims-swapped", "name-changed", "block-count-up", "block-count-down")
GGUF_NOOP = ("noop-name-metadata", "noop-rewrite")
GGUF_CLASSES = [*GGUF_REFUSE, *GGUF_NOOP]
GGML_TYPES = (0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 15, 30)  # F32 F16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K..Q8_K BF16


class GgufTable:
    """A GGUF's bytes and, per tensor, the file offsets of its name, dims, type and data offset."""

    def __init__(self, path: Path):
        import gguf

        r = gguf.GGUFReader(path)
        at = lambda part: int(part.ctypes.data - r.data.ctypes.data)  # noqa: E731
        self.blob = path.read_bytes()
        self.align = 32
        self.tensors = []
        for t in r.tensors:
            p = t.field.parts
            self.tensors.append({"name": t.name, "name_at": at(p[1]), "dims_at": at(p[3]), "n_dims": len(t.shape),
                                 "type_at": at(p[-2]), "offset_at": at(p[-1]), "offset": int(p[-1][0])})
        f = r.fields["general.name"] if "general.name" in r.fields else None
        self.name_at = (at(f.parts[-1]), len(bytes(f.parts[-1]))) if f is not None else None
        bc = r.fields[f"{r.fields['general.architecture'].contents()}.block_count"]
        self.block_count_at, self.block_count = at(bc.parts[-1]), int(bc.contents())


def _u(data: bytearray, at: int, n: int = 8) -> int:
    return int.from_bytes(data[at:at + n], "little")


def _put(data: bytearray, at: int, value: int, n: int = 8) -> None:
    data[at:at + n] = value.to_bytes(n, "little")


def gguf_case(cls: str, g: GgufTable, rng: random.Random) -> bytes:
    data = bytearray(g.blob)
    t = rng.choice(g.tensors)
    o = rng.choice([x for x in g.tensors if x is not t])
    if cls == "offset-misaligned":
        _put(data, t["offset_at"], t["offset"] + rng.choice([1, 2, 4, 8, 16, 31]))
    elif cls == "offset-overlap":
        _put(data, t["offset_at"], o["offset"])
    elif cls == "offset-past-end":
        _put(data, t["offset_at"], rng.choice([len(data), 2**40, 2**63 - 32]) // 32 * 32)
    elif cls == "offset-gap":
        last = max(g.tensors, key=lambda x: x["offset"])
        _put(data, last["offset_at"], last["offset"] + 32 * rng.randint(1, 4))
        data += bytes(32 * 4)  # (still inside the file: only the gap is wrong)
    elif cls == "type-changed":
        now = _u(data, t["type_at"], 4)
        _put(data, t["type_at"], rng.choice([x for x in GGML_TYPES if x != now]), 4)
    elif cls == "dim-changed":
        i = rng.randrange(t["n_dims"])
        d = _u(data, t["dims_at"] + 8 * i)
        _put(data, t["dims_at"] + 8 * i, rng.choice([d * 2, max(1, d // 2), d + 32, 2**40]))
    elif cls == "dim-zero":
        _put(data, t["dims_at"] + 8 * rng.randrange(t["n_dims"]), 0)
    elif cls == "dims-swapped":
        t = rng.choice([x for x in g.tensors if x["n_dims"] == 2] or g.tensors)
        a, b = _u(data, t["dims_at"]), _u(data, t["dims_at"] + 8)
        if a == b:  # a square one swapped is itself: grow it instead
            b *= 2
        _put(data, t["dims_at"], b)
        _put(data, t["dims_at"] + 8, a)
    elif cls == "name-changed":
        at = t["name_at"] + rng.randrange(len(t["name"]))
        data[at] = ord(rng.choice([c for c in "xyz0123." if ord(c) != data[at]]))
    elif cls == "block-count-up":
        _put(data, g.block_count_at, g.block_count + rng.randint(1, 3), 4)
    elif cls == "block-count-down":
        _put(data, g.block_count_at, max(0, g.block_count - rng.randint(1, 2)), 4)
    elif cls == "noop-name-metadata" and g.name_at is not None:
        at, n = g.name_at
        data[at:at + n] = bytes(rng.choice(b"abcdefgh") for _ in range(n))
    return bytes(data)


def run_gguf(n: int, seed: int) -> list[tuple[str, str, str]]:
    """(class, outcome, detail) for n mutated GGUF tables, each repacked in process."""
    from turbo.errors import TurboError
    from turbo.repack import repack
    from turbo.testing import make_checkpoint
    from turbo.testing.gguf_writer import write_gguf

    tmp = Path(tempfile.mkdtemp(prefix="turbo-fuzz-gguf-"))
    try:
        make_checkpoint(tmp / "hf", 0, hidden_size=64, intermediate_size=128, head_dim=32, linear_key_head_dim=32,
                        linear_value_head_dim=32, num_hidden_layers=4)
        base = write_gguf(tmp / "hf", tmp / "base.gguf", "Q8_0", mtp="none")
        digest = lambda d: hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
        want = digest(repack(base, tmp / "ref", quiet=True, open_layout=False))
        g, rng, out = GgufTable(base), random.Random(seed), []
        for i in range(n):
            cls = GGUF_CLASSES[i % len(GGUF_CLASSES)]
            path, dest = tmp / "case.gguf", tmp / "case"
            path.write_bytes(gguf_case(cls, g, rng))
            try:
                repack(path, dest, quiet=True, open_layout=False)
            except TurboError as e:
                out.append((cls, "turbo_error" if "\n" not in str(e) else "other-exception", str(e)[:200]))
            except Exception as e:  # noqa: BLE001 (the finding)
                out.append((cls, "other-exception", f"{type(e).__name__}: {str(e)[:200]}"))
            else:
                same = digest(dest) == want
                out.append((cls, "accepted-should-refuse" if cls in GGUF_REFUSE else
                            "repacked-equal" if same else "repacked-changed", ""))
            shutil.rmtree(dest, ignore_errors=True)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

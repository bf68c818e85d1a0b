"""Fuzz an install's files: every case a mutated copy, run in a worker subprocess, its outcome classified.

    python -m scripts.fuzz --headers N --configs M --drafters K --fields F [--install tiny] [--seed 0]

--drafters and --fields are scripts/fuzz_classes.py's: caller's drafter objects that misbehave,
and config.json fields judged against transformers (on a small checkpoint made for the run).
--bodies and --gguf are scripts/fuzz_inputs.py's, --requests scripts/fuzz_requests.py's (schemas,
grammars, tools and tool results at depth and size, posted in the worker process: a crash counted).

Each case mutates one file of the install (a safetensors header for --headers; config.json or
dflash/config.json for --configs) and runs turbo.open + a short greedy generation on it in a
worker process, which is restarted after a crash (counted as `crash`) or a case that outlives
--timeout (`hang`). Outcomes:

    turbo_error              one-line TurboError                                       ok
    generated-equal          the unmutated install's greedy tokens                     ok
    generated-changed-valid  other tokens from a valid value that changes the model    ok
    generated-sampled        a well-formed drafter's sampled text (a q is checked)       ok
    matches-reference        accepted, its logits transformers' on the same config      ok
    silent-change            accepted, its logits not transformers' on that config      BAD
    generated-changed        other tokens from a mutation that should not change them  BAD
    accepted-should-refuse   generated from a value no checkpoint may carry            BAD
    other-exception          any other exception, or a TurboError of several lines     BAD
    accepted-but-library-refuses  generated although safetensors refuses it            BAD
    layout-ignored           the open layout (packed.safetensors) refused by the library:  ok
                             left aside with its one-line note, the weights' own tokens
    crash / hang                                                                       BAD

The worker also reports whether the safetensors library and turbo's own header reader accept
a mutated safetensors file, so callers can assert they agree.
"""

from __future__ import annotations

import argparse
import json
import random
import select
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from scripts import fuzz_classes, fuzz_inputs, fuzz_requests
from turbo.store.install import resolve
from turbo.store.layout_file import PACKED_FILE

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 6, 7]
NEW_TOKENS = 4
STARTUP_S = 600.0
MARK = "@@fuzz "  # prefixes the worker's replies: anything else on its stdout is not ours
BAD = ("generated-changed", "other-exception", "accepted-but-library-refuses", "accepted-should-refuse", "crash",
       "hang", "silent-change", "error-5xx", "error-malformed", "served-changed", "repacked-changed")
# The library keeps the last of a name given twice; turbo refuses it (turbo/store/safetensors_format.py).
STRICTER_THAN_LIBRARY = ("duplicate-tensor",)


@dataclass
class Case:
    cls: str  # the mutation class
    file: str  # the mutated file, relative to the install
    blob: bytes  # its new content
    must_refuse: bool = False  # a value no honest checkpoint carries: generating from it is a finding
    may_change_output: bool = False  # a valid value that changes the model's meaning (rope_theta 1e7 -> 1e12)
    job: dict | None = None  # more for the worker (fuzz_classes: a drafter case, a field case's checkpoint)


@dataclass
class Outcome:
    case: Case
    outcome: str
    library_ok: bool | None = None
    turbo_header_ok: bool | None = None
    detail: str = ""


# ---- safetensors header mutations -------------------------------------------------------------


@dataclass
class StFile:
    """A parsed safetensors file: its header (tensor entries in order) and data section."""

    header: dict
    data: bytes

    @classmethod
    def parse(cls, blob: bytes) -> StFile:
        (n,) = struct.unpack("<Q", blob[:8])
        return cls(json.loads(blob[8:8 + n]), blob[8 + n:])

    def tensors(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]

    def blob(self, text: str | None = None, length_delta: int = 0, data: bytes | None = None) -> bytes:
        raw = (json.dumps(self.header, separators=(",", ":")) if text is None else text).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw) + length_delta) + raw + (self.data if data is None else data)


def _entry(rng: random.Random, f: StFile) -> dict:
    return f.header[rng.choice(f.tensors())]


def _by_offset(f: StFile) -> list[str]:
    return sorted(f.tensors(), key=lambda k: f.header[k]["data_offsets"])


def m_length(rng, f):
    return f.blob(length_delta=rng.choice([-2, -1, 1, 2]))


def m_shift(rng, f):
    e = _entry(rng, f)
    k = rng.choice([1, 2, 8, 64])
    e["data_offsets"] = [e["data_offsets"][0] + k, e["data_offsets"][1] + k]
    return f.blob()


def m_overlap(rng, f):
    names = _by_offset(f)
    i = rng.randrange(1, len(names))
    f.header[names[i]]["data_offsets"][0] = f.header[names[i - 1]]["data_offsets"][0]
    return f.blob()


def m_into_header(rng, f):
    # offsets counted from the file's start (the header) instead of from the data section
    skip = len(f.blob()) - len(f.data)
    for k in f.tensors():
        f.header[k]["data_offsets"] = [o + skip for o in f.header[k]["data_offsets"]]
    return f.blob()


def m_negative(rng, f):
    _entry(rng, f)["data_offsets"][0] = -rng.choice([1, 8])
    return f.blob()


def m_gap(rng, f):
    names = _by_offset(f)
    cut = f.header[names[rng.randrange(len(names))]]["data_offsets"][1]
    g = rng.choice([1, 4, 8])
    for k in names:
        f.header[k]["data_offsets"] = [o + g if o >= cut and o > 0 else o for o in f.header[k]["data_offsets"]]
    return f.blob(data=f.data[:cut] + b"\0" * g + f.data[cut:])


def m_trailing(rng, f):
    return f.blob(data=f.data + b"\0" * rng.choice([1, 2, 8]))


def m_truncated(rng, f):
    return f.blob(data=f.data[:-rng.choice([1, 2, 8])])


def _append_raw(f: StFile, raw_entry: str) -> bytes:
    text = json.dumps(f.header, separators=(",", ":"))
    return f.blob(text[:-1] + "," + raw_entry + "}")


def m_duplicate_tensor(rng, f):
    name = rng.choice(f.tensors())
    return _append_raw(f, json.dumps(name) + ":" + json.dumps(f.header[name]))


def m_duplicate_field(rng, f):
    name = rng.choice(f.tensors())
    e = json.dumps(f.header.pop(name))
    return _append_raw(f, json.dumps(name) + ":" + e[:-1] + ',"dtype":' + json.dumps(json.loads(e)["dtype"]) + "}")


def m_duplicate_metadata(rng, f):
    f.header.pop("__metadata__", None)
    return _append_raw(f, '"__metadata__":{},"__metadata__":{"k":"v"}')


def m_wrong_type(rng, f):
    e = _entry(rng, f)
    field = rng.choice(["shape", "data_offsets"])
    i = rng.randrange(len(e[field])) if e[field] else None
    bad = rng.choice([str, float, lambda v: None, lambda v: True, lambda v: [v]])
    if i is None or rng.random() < 0.3:
        e[field] = json.dumps(e[field]) if bad is str else 1.5 if bad is float else bad(e[field])
    else:
        e[field][i] = bad(e[field][i])
    return f.blob()


def m_dtype(rng, f):
    e = _entry(rng, f)
    e["dtype"] = rng.choice([[e["dtype"]], e["dtype"].lower(), "Q4", 3, None, {"t": e["dtype"]}])
    return f.blob()


def m_huge_int(rng, f):
    e = _entry(rng, f)
    field = rng.choice(["shape", "data_offsets"])
    value = rng.choice([2**64, 2**64 - 1, 10**30, 2**63])
    if e[field]:
        e[field][rng.randrange(len(e[field]))] = value
    else:
        e[field] = [value]
    return f.blob()


def m_deep_nesting(rng, f):
    d = rng.choice([124, 125, 126, 200, 5000])
    text = json.dumps(f.header, separators=(",", ":"))
    return f.blob(text[:-1] + ',"x":{"k":' + "[" * d + "]" * d + "}}")


def m_metadata_not_object(rng, f):
    f.header["__metadata__"] = rng.choice([[], "pt", 1, None, {"k": 1}, {"k": None}, [["k", "v"]]])
    return f.blob()


def _drop_bytes(f: StFile, name: str) -> bytes:
    b, e = f.header[name]["data_offsets"]
    for k in f.tensors():
        f.header[k]["data_offsets"] = [o - (e - b) if o >= e else o for o in f.header[k]["data_offsets"]]
    f.header[name]["data_offsets"] = [b, b]
    return f.data[:b] + f.data[e:]


def m_zero_dim(rng, f):
    name = rng.choice(f.tensors())
    data = _drop_bytes(f, name)
    f.header[name]["shape"] = [0] + f.header[name]["shape"][1:]
    return f.blob(data=data)


def m_extra_dim(rng, f):
    e = _entry(rng, f)
    e["shape"] = e["shape"] + [1] if rng.random() < 0.5 else [1] + e["shape"]
    return f.blob()


def m_shadowing_prefix(rng, f):
    name = rng.choice(f.tensors())
    prefix, rest = name.split(".", 1)
    other = {"dflash": "trunk", "trunk": "dflash", "mtp": "dflash"}.get(prefix, "trunk")
    f.header[other + "." + rest] = f.header.pop(name)
    return f.blob()


def m_noop_reorder(rng, f):
    items = list(f.header.items())
    rng.shuffle(items)
    f.header = dict(items)
    return f.blob()


def m_noop_padding(rng, f):
    return f.blob(json.dumps(f.header, separators=(",", ":")) + " " * rng.choice([1, 8, 100]))


def m_noop_unknown_field(rng, f):
    _entry(rng, f)["x-note"] = {"by": "fuzz", "n": [1, -2, 3.5]}
    return f.blob()


def m_noop_metadata_key(rng, f):
    f.header["__metadata__"] = {**(f.header.get("__metadata__") or {}), "fuzz": "1"}
    return f.blob()


HEADER_MUTATORS: dict[str, Callable[[random.Random, StFile], bytes]] = {
    "length-off": m_length, "offsets-shifted": m_shift, "offsets-overlap": m_overlap,
    "offsets-into-header": m_into_header, "offsets-negative": m_negative, "gap": m_gap,
    "trailing-bytes": m_trailing, "truncated": m_truncated, "duplicate-tensor": m_duplicate_tensor,
    "duplicate-field": m_duplicate_field, "duplicate-metadata": m_duplicate_metadata, "wrong-type": m_wrong_type,
    "dtype-bad": m_dtype, "huge-int": m_huge_int, "deep-nesting": m_deep_nesting,
    "metadata-not-object": m_metadata_not_object, "zero-dim": m_zero_dim, "extra-dim": m_extra_dim,
    "shadowing-prefix": m_shadowing_prefix, "noop-reorder": m_noop_reorder, "noop-padding": m_noop_padding,
    "noop-unknown-field": m_noop_unknown_field, "noop-metadata-key": m_noop_metadata_key,
}


def header_cases(install: Path, n: int, seed: int) -> Iterator[Case]:
    """n header mutations, the classes in turn, each on a random safetensors file of the install
    (made one at a time: thousands of mutated weight files do not fit in memory)."""
    rng = random.Random(seed)
    files = sorted(str(p.relative_to(install)) for p in install.rglob("*.safetensors"))
    blobs = {f: (install / f).read_bytes() for f in files}
    classes = list(HEADER_MUTATORS)
    for i in range(n):
        cls, file = classes[i % len(classes)], rng.choice(files)
        yield Case(cls, file, HEADER_MUTATORS[cls](rng, StFile.parse(blobs[file])))


# ---- config.json / dflash/config.json mutations ------------------------------------------------

NAN, INF = float("nan"), float("inf")
POS_BAD = (0, -1, -2**63, 2**31, 2**64, 10**12)  # every width is checked against the tensors, 2^31 is past them
EPS_BAD = (0, -1, 1, 1.5, 1e12, NAN, INF, -INF)
THETA_BAD = (0, -1, -1e6, NAN, INF, -INF)
HUGE_DIGITS = (400, 4000, 5000)  # 5000: past Python's int-from-text limit (4300 digits)
NEST_DEPTHS = (50, 900, 1000, 5000, 100000)


@dataclass(frozen=True)
class Field:
    """A field the runtime reads. A value in `bad`/`valid` may be a function of the file's config."""

    path: str  # dotted, inside the file's object
    kind: str  # int | float | bool | ids | list | str
    bad: tuple = ()  # values that must be refused
    valid: tuple = ()  # values that must be accepted (output may change only in config.json)
    optional: bool = False  # absent is fine (the format's default, or a field only eos stops read)


def _flip_first(c: dict) -> list:
    kinds = list(c["layer_types"])
    kinds[0] = "full_attention" if kinds[0] == "linear_attention" else "linear_attention"
    return kinds


TRUNK_FIELDS = [Field(k, "int", POS_BAD) for k in (
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim")] + [
    Field("max_position_embeddings", "int", POS_BAD + (2**24 + 1,), (1024, 2**24)),
    Field("rms_norm_eps", "float", EPS_BAD, (1e-5, 0.5)),
    Field("rope_parameters.rope_theta", "float", THETA_BAD, (lambda c: c["rope_parameters"]["rope_theta"] + 1, 1e12)),
    Field("rope_parameters.partial_rotary_factor", "float", (0, -0.25, 1.5, 1e12, NAN, INF), (0.5, 1.0), optional=True),
    Field("tie_word_embeddings", "bool"),
    Field("eos_token_id", "ids", (-1, lambda c: c["vocab_size"], 2**64, [0, -1], lambda c: [0, c["vocab_size"]]),
          ([0, 1], 3, []), optional=True),
    Field("layer_types", "list", (["sliding_attention"], [None], [3]), optional=True),
    Field("model_type", "str", ("llama", "", "qwen3_5_vl", "Qwen3_5_text"), ("qwen3_5", "qwen3_5_text")),
]
DRAFTER_FIELDS = [Field(k, "int", POS_BAD) for k in (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "vocab_size", "dflash_config.selector_rank")] + [
    Field("sliding_window", "int", POS_BAD + (lambda c: 2**16 + 1,), (1, 16)),
    Field("rms_norm_eps", "float", EPS_BAD, (1e-3,)),
    Field("rope_parameters.rope_theta", "float", THETA_BAD, (1e4, 1e12)),
    Field("is_causal", "bool", (), (True, False)),
    Field("layer_types", "list", (["full_attention"] * 5, [None] * 5, [])),
    Field("architectures", "list", (["Qwen3ForCausalLM"], [], ["DFlash2DraftModel"] * 2)),
    Field("dflash_config.block_size", "int", (1, 0, -1, -2**63, 2**31), (2, 4, 16)),
    Field("dflash_config.mask_token_id", "int", (-1, lambda c: c["vocab_size"], 2**64), (0, 2)),
    Field("dflash_config.target_layer_ids", "list", ([], [-1], lambda c: c["dflash_config"]["target_layer_ids"] + [99],
                                                     lambda c: [True] * len(c["dflash_config"]["target_layer_ids"])),
          (lambda c: c["dflash_config"]["target_layer_ids"][::-1],)),
    Field("dflash_config.conv_kernel_size", "int", (0, -1, 1, 3, 2**31)),
    Field("dflash_config.conv_group_size", "int", (0, -1, 24, 2**31)),
    Field("dflash_config.selector_top_k", "int", (1, 0, -1, lambda c: c["vocab_size"] + 1), (2, 8)),
]


def _seek(cfg: dict, path: str) -> tuple[dict, str]:
    *parents, leaf = path.split(".")
    node = cfg
    for k in parents:
        node = node.setdefault(k, {})
    return node, leaf


def _resolve(value, cfg: dict):
    return value(cfg) if callable(value) else value


def _wrong_types(kind: str, v) -> list:
    """Values of another JSON type than a `kind` field's `v` (null is absence: see 'removed')."""
    if kind == "int":
        return [str(v), v + 0.5, float(v), [v], True, {"v": v}, NAN]
    if kind == "float":
        return [str(v), [v], True, {"v": v}]
    if kind == "bool":
        return [int(v), str(v).lower(), [v], {"v": v}, "yes"]
    if kind == "ids":
        return ["0", 0.5, True, {"id": 0}, [[0]], ["0"], [0.0]]
    if kind == "list":
        return [json.dumps(v), {"0": v}, 7, True]
    return [3, [v], True, {"v": v}, 1.5]  # str


def _splice(cfg: dict, path: str, raw: str) -> str:
    """The config's text with the value at `path` replaced by `raw` (JSON no encoder writes)."""
    node, leaf = _seek(cfg, path)
    node[leaf] = "@@raw@@"
    return json.dumps(cfg, indent=2).replace('"@@raw@@"', raw)


def _trunk_inconsistent(c: dict) -> list[Callable[[dict], None]]:
    """Single values fine alone that disagree with another field or with the tensors."""
    n, kinds = c["num_hidden_layers"], c.get("layer_types")

    def put(**kv):
        return lambda cfg: cfg.update(kv)

    def rope(key, v):
        return lambda cfg: cfg["rope_parameters"].__setitem__(key, v)

    edits = [put(num_attention_heads=c["num_key_value_heads"] + 1), put(num_key_value_heads=c["num_attention_heads"] - 1),
             put(num_key_value_heads=c["num_attention_heads"]), put(linear_num_key_heads=c["linear_num_value_heads"] - 1),
             put(linear_num_value_heads=c["linear_num_value_heads"] + c["linear_num_key_heads"]),
             put(hidden_size=c["hidden_size"] + 8), put(head_dim=c["head_dim"] // 2), put(vocab_size=c["vocab_size"] - 1),
             put(intermediate_size=c["intermediate_size"] + 1), put(linear_conv_kernel_dim=c["linear_conv_kernel_dim"] + 1),
             put(linear_key_head_dim=c["linear_key_head_dim"] * 2), put(tie_word_embeddings=not c["tie_word_embeddings"]),
             put(num_hidden_layers=n + 1), rope("partial_rotary_factor", 0.001), rope("partial_rotary_factor", 0.3),
             put(eos_token_id=c["vocab_size"])]
    if kinds is not None:
        edits += [put(layer_types=kinds + ["full_attention"]), put(layer_types=kinds[:-1]),
                  put(layer_types=_flip_first(c)), put(num_hidden_layers=n - 1, layer_types=kinds[:-1])]
    return edits


def _drafter_inconsistent(c: dict) -> list[Callable[[dict], None]]:
    d, ids = c["dflash_config"], c["dflash_config"]["target_layer_ids"]

    def put(**kv):
        return lambda cfg: cfg.update(kv)

    def dput(**kv):
        return lambda cfg: cfg["dflash_config"].update(kv)

    return [put(num_key_value_heads=c["num_attention_heads"] - 1), put(num_attention_heads=c["num_key_value_heads"] + 1),
            put(num_attention_heads=c["num_attention_heads"] * 2), put(head_dim=c["head_dim"] - 1),
            put(head_dim=c["head_dim"] // 2), put(hidden_size=c["hidden_size"] // 2), put(vocab_size=c["vocab_size"] - 1),
            put(intermediate_size=c["intermediate_size"] + 2), put(sliding_window=2**31),
            put(num_hidden_layers=c["num_hidden_layers"] - 1, layer_types=c["layer_types"][:-1]),
            put(num_hidden_layers=c["num_hidden_layers"] + 1, layer_types=c["layer_types"] + c["layer_types"][:1]),
            dput(target_layer_ids=[ids[0]] + ids[:-1]), dput(target_layer_ids=ids[:-1]), dput(target_layer_ids=ids + ids[:1]),
            dput(selector_rank=d["selector_rank"] * 2), dput(conv_group_size=d["conv_group_size"] * 2),
            dput(mask_token_id=c["vocab_size"])]


def _max_positions_window(install: Path) -> Callable[[dict], None]:
    """A window past the trunk's max_position_embeddings."""
    limit = json.loads((install / "config.json").read_text())["max_position_embeddings"]
    return lambda cfg: cfg.update(sliding_window=limit + 1)


def config_case(rng: random.Random, cls: str, text: str, fields: list[Field], inconsistent: list) -> tuple[str, bool, bool]:
    """(the mutated text, must_refuse, may_change_output) for one mutation of class `cls`."""
    cfg = json.loads(text)
    f = rng.choice(fields)
    node, leaf = _seek(cfg, f.path)
    if cls == "removed":
        f = rng.choice([g for g in fields if _seek(cfg, g.path)[1] in _seek(cfg, g.path)[0]])
        node, leaf = _seek(cfg, f.path)
        if rng.random() < 0.5:
            del node[leaf]
        else:
            node[leaf] = None
        return json.dumps(cfg, indent=2), not f.optional, False
    if cls == "wrong-type":
        current = node.get(leaf)
        sample = {"int": 8, "float": 1e-6, "bool": True, "ids": 0, "list": ["x"], "str": "x"}[f.kind]
        node[leaf] = rng.choice(_wrong_types(f.kind, current if current is not None else sample))
        return json.dumps(cfg, indent=2), True, False
    if cls == "out-of-range":
        f = rng.choice([g for g in fields if g.bad])
        node, leaf = _seek(cfg, f.path)
        node[leaf] = _resolve(rng.choice(f.bad), cfg)
        return json.dumps(cfg, indent=2), True, False
    if cls == "inconsistent":
        rng.choice(inconsistent)(cfg)
        return json.dumps(cfg, indent=2), True, False
    if cls == "huge-int":
        return _splice(cfg, f.path, "-" * rng.randrange(2) + "9" * rng.choice(HUGE_DIGITS)), True, False
    if cls == "deep-nesting":
        d = rng.choice(NEST_DEPTHS)
        return _splice(cfg, f.path, "[" * d + "]" * d), True, False
    if cls == "semantic":
        f = rng.choice([g for g in fields if g.valid])
        node, leaf = _seek(cfg, f.path)
        node[leaf] = _resolve(rng.choice(f.valid), cfg)
        return json.dumps(cfg, indent=2), False, True
    assert cls == "noop", cls
    items = list(cfg.items())
    rng.shuffle(items)
    cfg = dict(items) | ({"x-fuzz": {"n": [1, -2.5, None]}} if rng.random() < 0.5 else {})
    return json.dumps(cfg, indent=rng.choice([None, 1, 4]), separators=rng.choice([None, (",", ":")])), False, False


CONFIG_CLASSES = ("removed", "wrong-type", "out-of-range", "inconsistent", "huge-int", "deep-nesting", "semantic",
                  "noop")


def config_cases(install: Path, n: int, seed: int) -> list[Case]:
    """n mutations of config.json and (where the install has one) dflash/config.json, the classes
    in turn. A drafter config's valid changes must leave the tokens alone (the speculation is
    lossless); a trunk config's may change them."""
    rng = random.Random(seed)
    trunk_text = (install / "config.json").read_text()
    targets = [("config.json", TRUNK_FIELDS, _trunk_inconsistent(json.loads(trunk_text)))]
    drafter = install / "dflash" / "config.json"
    if drafter.is_file():
        inconsistent = _drafter_inconsistent(json.loads(drafter.read_text())) + [_max_positions_window(install)]
        targets.append(("dflash/config.json", DRAFTER_FIELDS, inconsistent))
    texts = {file: (install / file).read_text() for file, _, _ in targets}
    cases = []
    for i in range(n):
        file, fields, inconsistent = targets[(i // len(CONFIG_CLASSES)) % len(targets)]
        cls = CONFIG_CLASSES[i % len(CONFIG_CLASSES)]
        text, refuse, may_change = config_case(rng, cls, texts[file], fields, inconsistent)
        may_change = may_change and file == "config.json"
        cases.append(Case(f"{file.split('/')[0].removesuffix('.json')}:{cls}", file, text.encode(), refuse, may_change))
    return cases


def drafter_cases(install: Path, n: int, seed: int) -> list[Case]:
    return [Case(f"drafter:{cls}", "", b"", refuse, job=job) for cls, job, refuse in fuzz_classes.drafter_cases(n, seed)]


def field_cases(hf_dir: Path, install: Path, n: int, seed: int) -> list[Case]:
    base = json.loads((install / "config.json").read_text())
    return [Case(f"field:{cls}", "config.json", text.encode(), job={"hf": str(hf_dir)})
            for cls, text in fuzz_classes.field_cases(base, n, seed)]


TARGETS: dict[str, Callable[[Path, int, int], Iterable[Case]]] = {"headers": header_cases, "configs": config_cases,
                                                                  "drafters": drafter_cases}


# ---- running cases ----------------------------------------------------------------------------


def case_install(base: Path, case: Case, into: Path) -> Path:
    """The base install with one file replaced: every other file a symlink to the base's."""
    for src in base.rglob("*"):
        dst = into / src.relative_to(base)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src.resolve())
    (into / case.file).unlink()
    (into / case.file).write_bytes(case.blob)
    return into


def worker() -> None:
    """Reads {"install", "file"} lines; replies with what the library, turbo's reader and turbo.open made of it."""
    from safetensors import safe_open

    import turbo
    from turbo.errors import TurboError
    from turbo.store.safetensors_format import read_header

    runtimes: dict = {}  # the drafter cases' runtime and greedy tokens (one per install, every case on it)
    apps: dict = {}  # the request cases' apps, one per template
    for line in sys.stdin:
        job = json.loads(line)
        reply: dict = {}
        if "route" in job:
            print(MARK + json.dumps(fuzz_requests.reply(job, apps)), flush=True)
            continue
        if "drafter" in job or "hf" in job:
            print(MARK + json.dumps(class_reply(job, runtimes)), flush=True)
            continue
        if (job.get("file") or "").endswith(".safetensors"):
            path = Path(job["install"]) / job["file"]
            try:
                with safe_open(str(path), "pt"):
                    reply["library_ok"] = True
            except Exception:
                reply["library_ok"] = False
            try:
                read_header(path)
                reply["turbo_header_ok"] = True
            except TurboError:
                reply["turbo_header_ok"] = False
        try:
            rt = turbo.open(job["install"], backend="cpu")
            out = rt.generate(PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False)
            reply |= {"result": "generated", "tokens": out.tokens, "layout_note": rt.install.layout_note}
        except TurboError as e:
            reply |= {"result": "turbo_error", "message": str(e)}
        except Exception as e:  # the outcome we are looking for: any other exception is a finding
            reply |= {"result": "other", "message": f"{type(e).__name__}: {e}"}
        print(MARK + json.dumps(reply), flush=True)


def class_reply(job: dict, runtimes: dict) -> dict:
    """A fuzz_classes case's reply, in the worker."""
    import turbo
    from turbo.errors import TurboError

    try:
        if "hf" in job:
            return fuzz_classes.field_job(Path(job["install"]), Path(job["hf"]))
        if job["install"] not in runtimes:
            rt = turbo.open(job["install"], backend="cpu")
            runtimes[job["install"]] = rt, rt.generate(fuzz_classes.PROMPT, max_new_tokens=fuzz_classes.DRAFTER_TOKENS,
                                                       stop_at_eos=False, policy="off").tokens
        rt, reference = runtimes[job["install"]]
        tokens = fuzz_classes.drafter_job(rt, job, reference)
        if job["drafter"].startswith("q-"):  # sampled: some valid text of the asked length
            return {"result": "generated", "tokens": tokens, "sampled": len(tokens) == len(reference) and all(
                type(t) is int and 0 <= t < rt.install.arch.vocab for t in tokens)}
        return {"result": "generated", "tokens": tokens, "expected": reference}
    except TurboError as e:
        return {"result": "turbo_error", "message": str(e)}
    except Exception as e:  # the outcome we are looking for: any other exception is a finding
        return {"result": "other", "message": f"{type(e).__name__}: {e}"}


class Worker:
    """One worker subprocess, restarted after a crash or a hang."""

    def __init__(self, timeout: float):
        self.timeout, self.proc = timeout, None

    def ask(self, install: Path, file: str | None, timeout: float | None = None, job: dict | None = None) -> dict | str:
        """The worker's reply, or "crash" / "hang" (no reply within `timeout`, default the worker's)."""
        if self.proc is None:
            # (from the checkout's root: this checkout's turbo and scripts, not installed ones)
            self.proc = subprocess.Popen([sys.executable, "-m", "scripts.fuzz", "--worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
        self.proc.stdin.write(json.dumps({"install": str(install), "file": file} | (job or {})) + "\n")
        self.proc.stdin.flush()
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout or self.timeout)
            if not ready:
                self.close()
                return "hang"
            line = self.proc.stdout.readline()
            if not line:
                self.close()
                return "crash"
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def classify(case: Case, reply: dict | str, reference: list[int]) -> Outcome:
    if isinstance(reply, str):
        return Outcome(case, reply)
    o = Outcome(case, "", reply.get("library_ok"), reply.get("turbo_header_ok"), reply.get("message", ""))
    if reply["result"] == "turbo_error":
        o.outcome = "turbo_error" if "\n" not in o.detail else "other-exception"
    elif reply["result"] == "other":
        o.outcome = "other-exception"
    elif "reference" in reply:  # a field case: judged by transformers' logits
        o.outcome, o.detail = ("matches-reference", "") if reply["reference"] == "match" else (
            "silent-change", reply["reference"])
    elif reply.get("sampled") and not case.must_refuse:
        o.outcome, o.detail = "generated-sampled", str(reply["tokens"])
    elif (o.library_ok is False and case.file == PACKED_FILE and reply.get("layout_note")
          and reply["tokens"] == reference):  # a derived file: packed at open instead, said
        o.outcome, o.detail = "layout-ignored", reply["layout_note"]
    elif o.library_ok is False:
        o.outcome = "accepted-but-library-refuses"
    elif case.must_refuse:
        o.outcome, o.detail = "accepted-should-refuse", str(reply["tokens"])
    else:
        o.detail = str(reply["tokens"])
        reference = reply.get("expected", reference)  # a drafter case's: its own greedy run's
        o.outcome = "generated-equal" if reply["tokens"] == reference else (
            "generated-changed-valid" if case.may_change_output else "generated-changed")
    return o


def run_cases(base: Path, cases: Iterable[Case], timeout: float = 60.0) -> list[Outcome]:
    w = Worker(timeout)
    try:
        ref = w.ask(base, None, max(timeout, STARTUP_S))  # the first ask imports torch and may build native.c
        if not isinstance(ref, dict) or ref["result"] != "generated":
            raise SystemExit(f"the unmutated install {base} does not generate: {ref}")
        outcomes = []
        with tempfile.TemporaryDirectory(prefix="turbo-fuzz-") as tmp:
            for i, case in enumerate(cases):
                install = case_install(base, case, Path(tmp) / f"case{i}") if case.file else base
                case.blob = b""  # written: the outcome keeps the case's class and file, not its bytes
                job = (case.job or {}) | ({"reference": ref["tokens"]} if "drafter" in (case.job or {}) else {})
                outcomes.append(classify(case, w.ask(install, case.file, job=job), ref["tokens"]))
                if case.file:
                    shutil.rmtree(install)
        return outcomes
    finally:
        w.close()


PROBE_EVERY = 25  # request cases between two probes: the unmutated requests, whose text must not change


def run_requests(n: int, seed: int, timeout: float = 60.0) -> list[Outcome]:
    """n fuzz_requests cases, each posted in the worker process (a crash or a hang is counted, the
    worker restarted); every PROBE_EVERY cases and at the end, the unmutated requests again."""
    w, rng, out = Worker(timeout), random.Random(seed), []
    ask = lambda cls, route, template, body, t=None: w.ask(ROOT, None, t, job={  # noqa: E731
        "cls": cls, "route": route, "template": template, "body": body})
    try:
        want = {}
        for route, body in fuzz_requests.GOOD:  # (the first ask starts the worker: torch, the engine)
            ref = ask("probe", route, "own", json.dumps(body), max(timeout, STARTUP_S))
            if not isinstance(ref, dict) or ref.get("outcome") != "served":
                raise SystemExit(f"the unmutated request to {route} is not served: {ref}")
            want[route] = ref["text"]
        for i in range(n):
            cls = fuzz_requests.CLASSES[i % len(fuzz_requests.CLASSES)]
            route, template, body = fuzz_requests.request_case(cls, rng)
            reply = ask(cls, route, template, body)
            out.append(Outcome(Case(cls, f"{route} ({template} template)", b""), reply) if isinstance(reply, str)
                       else Outcome(Case(cls, route, b""), reply["outcome"], detail=reply["message"]))
            if i % PROBE_EVERY == PROBE_EVERY - 1 or i == n - 1:
                for route, body in fuzz_requests.GOOD:
                    reply = ask("probe", route, "own", json.dumps(body), max(timeout, STARTUP_S))
                    if isinstance(reply, str) or reply["outcome"] != "served" or reply["text"] != want[route]:
                        out.append(Outcome(Case("still-serving", route, b""), "served-changed", detail=str(reply)[:200]))
        return out
    finally:
        w.close()


def table(outcomes: list[Outcome]) -> str:
    names = sorted({o.outcome for o in outcomes}, key=lambda n: (n in BAD, n))
    counts = Counter((o.case.cls, o.outcome) for o in outcomes)
    classes = sorted({o.case.cls for o in outcomes})
    width = max(map(len, classes + ["class"]))
    rows = [f"{'class':<{width}}  " + "  ".join(names)]
    for c in classes:
        rows.append(f"{c:<{width}}  " + "  ".join(f"{counts[c, n] or '':>{len(n)}}" for n in names))
    rows.append(f"{'total':<{width}}  " + "  ".join(f"{sum(counts[c, n] for c in classes):>{len(n)}}" for n in names))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for target in TARGETS:
        parser.add_argument(f"--{target}", type=int, default=0, metavar="N", help=f"N {target} mutations")
    parser.add_argument("--fields", type=int, default=0, metavar="N",
                        help="N config.json field mutations on a small checkpoint, judged against transformers")
    parser.add_argument("--bodies", type=int, default=0, metavar="N",
                        help="N server request bodies against the app in process (scripts/fuzz_inputs.py)")
    parser.add_argument("--gguf", type=int, default=0, metavar="N",
                        help="N GGUF tensor tables repacked in process (scripts/fuzz_inputs.py)")
    parser.add_argument("--requests", type=int, default=0, metavar="N",
                        help="N requests with schemas, grammars, tools and tool results at depth and size, in a "
                             "worker process (scripts/fuzz_requests.py)")
    parser.add_argument("--install", default="tiny", help="the install to mutate (a directory or a shipped name)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a case counts as a hang")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return 0
    base = resolve(args.install).resolve()
    if not any(getattr(args, t) for t in TARGETS) and not (args.fields or args.bodies or args.gguf or args.requests):
        parser.error(f"nothing to do: give one of "
                     f"{', '.join('--' + t for t in [*TARGETS, 'fields', 'bodies', 'gguf', 'requests'])} N")
    cases = (c for t, make in TARGETS.items() for c in make(base, getattr(args, t), args.seed))
    outcomes = run_cases(base, cases, args.timeout) if any(getattr(args, t) for t in TARGETS) else []
    if args.fields:
        with tempfile.TemporaryDirectory(prefix="turbo-fuzz-fields-") as tmp:
            hf_dir, install = fuzz_classes.field_base(Path(tmp))
            outcomes += run_cases(install, field_cases(hf_dir, install, args.fields, args.seed), args.timeout)
    for run, n in ((fuzz_inputs.run_bodies, args.bodies), (fuzz_inputs.run_gguf, args.gguf)):
        if n:
            outcomes += [Outcome(Case(cls, "", b""), outcome, detail=detail) for cls, outcome, detail in run(n, args.seed)]
    if args.requests:
        outcomes += run_requests(args.requests, args.seed, args.timeout)
    print(table(outcomes))
    bad = [o for o in outcomes if o.outcome in BAD]
    for o in bad:
        print(f"BAD {o.outcome}: {o.case.cls} on {o.case.file}: {o.detail[:200]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

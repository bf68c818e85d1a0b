"""What the simulated device reads from a PTX image: its entries, each one's parameter list
(type and size, in order), its `.maxntid` and static shared bytes; and which kernel source
(kernels_ptx/<module>.cu or a registered directory's) those entries come from."""

from __future__ import annotations

import hashlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)\s*(.*?)\{", re.DOTALL)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+\w+(?:\s*\[\s*(\d+)\s*\])?")
_MAXNTID = re.compile(r"\.maxntid\s+(\d+)\s*(?:,\s*(\d+))?\s*(?:,\s*(\d+))?")
_SHARED = re.compile(r"\.shared\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+[\w$]+(?:\s*\[\s*(\d+)\s*\])?")
SIZES = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "f16": 2, "u32": 4, "s32": 4, "b32": 4,
         "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8}


@dataclass(frozen=True)
class Param:
    kind: str  # "u64", "u32", "f32", ... ("b8" with a count: a struct passed by value)
    size: int

    @property
    def floating(self) -> bool:
        return self.kind.startswith("f")


@dataclass(frozen=True)
class Entry:
    name: str
    params: tuple[Param, ...]
    max_threads: int | None  # .maxntid x*y*z (from __launch_bounds__)
    static_shared: int  # bytes of .shared the module declares (an upper bound for this entry)


def entries(text: str) -> dict[str, Entry]:
    """Every `.entry` of a PTX text."""
    static_shared = sum(SIZES.get(k, 1) * int(n or 1) for k, n in _SHARED.findall(text))
    out = {}
    for name, params, directives in _ENTRY.findall(text):
        ps = tuple(Param(kind, SIZES.get(kind, 1) * int(count or 1)) for _, kind, count in _PARAM.findall(params))
        m = _MAXNTID.search(directives)
        max_threads = None
        if m:
            max_threads = 1
            for g in m.groups():
                max_threads *= int(g or 1)
        out[name] = Entry(name, ps, max_threads, static_shared)
    return out


_GLOBAL_FN = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\(.*?\)\s*)?(\w+)\s*\(", re.DOTALL)


def source_entries(cu: Path) -> set[str]:
    """The __global__ functions a .cu defines, after its own macros expand (g++ -E, no shim:
    `__global__` stays a word)."""
    res = subprocess.run(["g++", "-E", "-P", "-x", "c++", "-D__CUDACC__", "-DTURBO_CUDA_SIM", str(cu)],
                         capture_output=True, text=True, check=False)
    text = res.stdout if res.returncode == 0 else cu.read_text()
    return set(_GLOBAL_FN.findall(text))


_source_cache: dict[tuple[Path, float], set[str]] = {}


def _entries_of(cu: Path, cache: Path | None) -> set[str]:
    """source_entries(cu), remembered per content hash in `cache` (g++ -E costs a few hundred ms)."""
    key = (cu.resolve(), cu.stat().st_mtime)
    if key not in _source_cache:
        data = cu.read_bytes()
        stored = cache / f"entries-{hashlib.sha256(data).hexdigest()[:20]}.txt" if cache else None
        if stored is not None and stored.is_file():
            _source_cache[key] = set(stored.read_text().split())
        else:
            _source_cache[key] = source_entries(cu)
            if stored is not None:
                stored.write_text("\n".join(sorted(_source_cache[key])))
    return _source_cache[key]


def find_source(names: set[str], dirs: list[Path], cache: Path | None = None) -> Path | None:
    """The .cu (first directory first) that defines every entry in `names`."""
    for d in dirs:
        for cu in sorted(Path(d).glob("*.cu")):
            if names and names <= _entries_of(cu, cache):
                return cu
    return None

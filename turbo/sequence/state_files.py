"""Kept states on disk (issue 58): the server's prefix cache across a restart (`serve.state_dir`,
`StateDir`) and a chat session's conversation (Session.save / load), as llama-server's slot save
and restore.

A file holds kept states (turbo/sequence/state_cache.py): each one's tokens, its recurrent snapshot
(the GDN and conv states, the position and rope delta: RecurrentSnapshot) and the drafter contexts
that are plain tensors and numbers; and one set of K/V rows below the longest of them (an entry's
are its first `pos` rows: a session's entries share its one state's rows). It is written whole:
into a temporary file in the same directory, flushed to the disk, renamed over the name.

The format is safetensors, read by turbo/store/safetensors_format.py as strictly as the library
reads it: data only, nothing in it runs (torch.load's pickle would, weights_only or not, be code
that a file in a shared directory hands us), and the project already reads and writes it. The
header's metadata ties the file to what produced it, and reading checks all of it before a tensor
is used, refusing by name in one line: the format's version, a SHA-256 over the metadata and every
tensor's bytes, the install (its weights' digest, its configs) and the numerics (the step, its
bf16 products, the ISA tier, the dtypes, the drafter's products, the open layout's version): a
state computed under other numerics would not be the bits this runtime's prefill gives.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..backends import native_lib
from ..errors import TurboError
from ..model.trunk import RecurrentSnapshot, Trunk
from ..store import layout_file
from ..store.install import DRAFTER_DIR, Install, safetensors_files
from ..store.safetensors_format import MAX_HEADER_BYTES, METADATA, parse_header, read_header, write_tensors
from .options import OpenOptions
from .state_cache import ByIdentity, DraftKey, Entry, StateCache

FORMAT_VERSION = 1
# a server's states queued for its writer at most (each holds its K/V rows until written)
QUEUED = 64
SUFFIX = ".turbo-state"  # a state directory's files (nothing else there is read or removed)
VERSION_KEY = "turbo.state"
DIGEST_KEY = "turbo.state.digest"
INSTALL_KEY = "turbo.state.install"
NUMERICS_KEY = "turbo.state.numerics"
ENTRIES_KEY = "turbo.state.entries"
EXTRA_PREFIX = "turbo.state.extra."  # the caller's own (a session's messages)
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32,
             "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8}  # what write_tensors writes
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


class StateFileError(TurboError):
    """A state file that is not used: one line naming it and why."""


# ---- what identifies the state's producer ------------------------------------------------------


@dataclass(frozen=True)
class Stamp:
    install: str  # install_fingerprint
    numerics: dict[str, str]  # numerics()


_FINGERPRINTS: dict[tuple[str, str], str] = {}  # (install path, its files' stat) -> fingerprint


def install_fingerprint(install: Install) -> str:
    """The install's identity: its weights' digest (every byte: layout_file.digest; a used open
    layout's recorded one, checked against the weights when the install opened), its drafter's,
    and its configs' bytes. Hashed once per process while the files' stat stays the same."""
    root = install.path
    weights = safetensors_files(root)
    drafter = root / DRAFTER_DIR
    drafter_weights = safetensors_files(drafter) if drafter.is_dir() else []
    configs = [p for p in (root / "config.json", drafter / "config.json") if p.is_file()]
    key = (str(root.resolve()), layout_file.stat_signature(weights + drafter_weights + configs))
    if key not in _FINGERPRINTS:
        source = None
        if install.packed:  # (layout_file.check proved it was built from these weights)
            source = (read_header(root / layout_file.PACKED_FILE).metadata or {}).get(layout_file.SOURCE_KEY)
        parts = [source or layout_file.digest(weights),
                 layout_file.digest(drafter_weights) if drafter_weights else "",
                 *(hashlib.sha256(p.read_bytes()).hexdigest() for p in configs)]
        _FINGERPRINTS[key] = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return _FINGERPRINTS[key]


def numerics(trunk: Trunk, opts: OpenOptions) -> dict[str, str]:
    """What makes a state's bits besides the weights: the step and where it runs, its dtypes,
    the native library's ISA tier and bf16 products, the drafter's products, the open layout."""
    native = trunk.step_name == "native"
    return {"step": trunk.step_name, "device": trunk.device.type, "dtype": str(trunk.dtype).removeprefix("torch."),
            "kv_dtype": str(trunk.kv_dtype).removeprefix("torch."),
            "bf16_products": str(native_lib.bf16_mode()) if native else "none",
            "isa": str(native_lib.tier()) if native else "none",
            "draft_products": native_lib.draft_layout(opts.draft_products) if native else opts.draft_products,
            "quant_cpu": opts.quant_cpu, "layout": str(layout_file.LAYOUT_VERSION)}


def stamp_of(install: Install, trunk: Trunk, opts: OpenOptions) -> Stamp:
    return Stamp(install_fingerprint(install), numerics(trunk, opts))


# ---- what a file holds of a kept state ----------------------------------------------------------


@dataclass
class Kept:
    """One kept state as a file holds it (its K/V rows are the file's, below `trunk.pos`)."""

    tokens: tuple  # the state holds tokens[:-1] (image rows tagged: turbo.vision.runtime.keyed_rows)
    trunk: RecurrentSnapshot  # per GDN layer its state [Hv, dk, dv] and conv window [K-1, C]; pos, rope delta
    drafts: dict[DraftKey, Any]  # drafter key -> its context there


def dense_kv(entry: Entry) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """An entry's K/V rows, layer -> K, V [Hkv, pos, d]: the one place that reads how a
    StateCache stores them (called on the engine's thread: what it returns must not change
    after, since the writer's thread reads it later: entry_kv's are new tensors)."""
    return StateCache.entry_kv(entry)


def kept_of(entry: Entry) -> Kept:
    return Kept(entry.tokens, entry.trunk, dict(entry.drafts))


def put(cache: StateCache, kept: Kept, kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None,
        live: bool = False) -> None:
    """A loaded state into a cache, with each drafter context it holds: the one place that hands
    a StateCache what a file held. `kv` None: a live keeper's entry (its state holds the rows);
    `live`: the entry is that state itself, as the last turn left it."""
    rows = None if kv is None else {i: (k[:, :kept.trunk.pos], v[:, :kept.trunk.pos]) for i, (k, v) in kv.items()}
    snap = None if live else kept.trunk
    cache.keep(list(kept.tokens), snap, rows)
    for key, context in kept.drafts.items():
        cache.keep(list(kept.tokens), snap, rows, key, context)


@dataclass
class StateFile:
    kept: list[Kept]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> K, V [Hkv, rows, d]: below the longest kept state
    extra: dict[str, str]  # the writer's own (write_states' extra)


class _Unplain(Exception):
    """A value that is not plain tensors, integers, strings, None, tuples and lists."""


def _plain(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """`obj` as JSON, its tensors moved into `tensors` under names starting `prefix`."""
    if isinstance(obj, torch.Tensor):
        if obj.dtype not in ST_NAMES:
            raise _Unplain(f"a {obj.dtype} tensor")
        name = f"{prefix}{len(tensors)}"
        tensors[name] = obj
        return {"tensor": name}
    if obj is None or isinstance(obj, str) or (isinstance(obj, int) and not isinstance(obj, bool)):
        return obj
    if isinstance(obj, (tuple, list)):
        return {type(obj).__name__: [_plain(x, tensors, prefix) for x in obj]}
    raise _Unplain(f"a {type(obj).__name__}")


def _unplain(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, dict):
        (kind, value), = node.items()
        if kind == "tensor":
            return tensors[value]
        items = [_unplain(x, tensors) for x in value]
        return tuple(items) if kind == "tuple" else items
    if node is None or isinstance(node, (int, str)):
        return node
    raise ValueError(f"unexpected {type(node).__name__}")


def _digest(meta: dict[str, str], tensors: dict[str, tuple[str, list[int], Any]]) -> str:
    """SHA-256 over the metadata (but the digest) and each tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != DIGEST_KEY}, sort_keys=True).encode())
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        h.update(f"\0{name}:{dtype}:{shape}\0".encode())
        h.update(data)
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> Any:
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def write_states(path: Path, stamp: Stamp, kept: list[Kept], kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 extra: dict[str, str] | None = None) -> list[str]:
    """`kept` and the K/V rows below the longest of them (`kv`: layer -> K, V [Hkv, >= rows, d])
    written whole to `path`. Returns a line for each drafter context left out (one that is not
    plain tensors and numbers: that drafter begins afresh from the loaded state)."""
    rows = max((k.trunk.pos for k in kept), default=0)
    tensors: dict[str, torch.Tensor] = {}
    for i, (k, v) in kv.items():
        tensors[f"kv.{i}.k"], tensors[f"kv.{i}.v"] = k[:, :rows].cpu(), v[:, :rows].cpu()
    entries, notes = [], []
    for n, k in enumerate(kept):
        try:
            tokens = _plain(list(k.tokens), {}, "")
        except _Unplain as e:
            raise TurboError(f"{path}: a kept state's tokens hold {e}, expected token ids") from None
        gdn = {}
        for layer, (s, w) in k.trunk.gdn.items():
            tensors[f"gdn.{n}.{layer}.s"], tensors[f"gdn.{n}.{layer}.w"] = s.cpu(), w.cpu()
            gdn[str(layer)] = [f"gdn.{n}.{layer}.s", f"gdn.{n}.{layer}.w"]
        drafts = []
        for key, snap in k.drafts.items():
            own: dict[str, torch.Tensor] = {}
            try:
                drafts.append([_plain(key, {}, ""), _plain(snap, own, f"draft.{n}.{len(drafts)}.")])
            except _Unplain as e:
                who = f"{key.obj!r} (a caller's own drafter)" if isinstance(key, ByIdentity) else repr(key)
                notes.append(f"{path.name}: drafter {who}: its context is left out ({e} is not plain tensors and "
                             "numbers); that drafter begins afresh from this state")
                continue
            tensors |= {name: t.cpu() for name, t in own.items()}
        entries.append({"tokens": tokens, "pos": k.trunk.pos, "rope_delta": k.trunk.rope_delta, "gdn": gdn,
                        "drafts": drafts})
    meta = {VERSION_KEY: str(FORMAT_VERSION), INSTALL_KEY: stamp.install,
            NUMERICS_KEY: json.dumps(stamp.numerics, sort_keys=True), ENTRIES_KEY: json.dumps(entries),
            **{EXTRA_PREFIX + k: v for k, v in (extra or {}).items()}}
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    meta[DIGEST_KEY] = _digest(meta, {name: (ST_NAMES[t.dtype], list(t.shape), _bytes(t))
                                      for name, t in tensors.items()})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write_tensors(tmp, tensors, meta)
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return notes


def _truncated(blob: bytearray) -> bool:
    """Whether the file ends before what its header declares (its header, or its tensors' bytes)."""
    if len(blob) < 8:
        return True
    n = int.from_bytes(blob[:8], "little")
    if n > MAX_HEADER_BYTES:
        return False
    if 8 + n > len(blob):
        return True
    try:
        header = json.loads(bytes(blob[8:8 + n]))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != METADATA), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return False
    return 8 + n + end > len(blob)


def read_states(path: Path, stamp: Stamp, device: torch.device) -> StateFile:
    """A state file written by write_states under `stamp`, its tensors on `device`; StateFileError
    (one line: the file and why) for anything else: truncated, not a state file, an unknown
    version, a digest mismatch, another install, other numerics."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # (a named pipe would block the reader)
            raise StateFileError(f"{path}: not a regular file")
        with path.open("rb") as f:
            blob = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(blob)
    except OSError as e:
        raise StateFileError(f"{path}: cannot read ({e.strerror})") from None
    if got != len(blob) or _truncated(blob):
        raise StateFileError(f"{path}: truncated ({len(blob)} bytes, shorter than its header declares)")
    try:
        header = parse_header(path, blob, len(blob))
    except TurboError as e:
        raise StateFileError(f"{path}: not a state file ({str(e).removeprefix(f'{path}: ')})") from None
    meta = header.metadata or {}
    if meta.get(VERSION_KEY) != str(FORMAT_VERSION):
        raise StateFileError(f"{path}: unknown version {meta.get(VERSION_KEY)!r} "
                             f"(this turbo reads state files of version {FORMAT_VERSION})")
    view = memoryview(blob)
    spans = {t.name: (t.dtype, list(t.shape), view[header.data_start + t.begin:header.data_start + t.end])
             for t in header.tensors.values()}
    if meta.get(DIGEST_KEY) != _digest(meta, spans):
        raise StateFileError(f"{path}: digest mismatch (damaged: its bytes are not the ones written)")
    if meta.get(INSTALL_KEY) != stamp.install:
        raise StateFileError(f"{path}: written by another install (weights {str(meta.get(INSTALL_KEY))[:12]}, "
                             f"this one's {stamp.install[:12]})")
    try:
        theirs = json.loads(meta[NUMERICS_KEY])
        other = [f"{k} {theirs.get(k)} (here {v})" for k, v in stamp.numerics.items() if theirs.get(k) != v]
    except (KeyError, ValueError, AttributeError):
        raise StateFileError(f"{path}: malformed (its numerics are not a JSON object)") from None
    if other or set(theirs) != set(stamp.numerics):
        raise StateFileError(f"{path}: written under other numerics: {', '.join(other) or 'other fields'}")
    try:
        tensors = {}
        for name, info in header.tensors.items():
            if info.dtype not in ST_DTYPES:
                raise ValueError(f"tensor {name} is {info.dtype}")
            dtype, count = ST_DTYPES[info.dtype], (info.end - info.begin) // ST_DTYPES[info.dtype].itemsize
            t = (torch.frombuffer(blob, dtype=dtype, count=count, offset=header.data_start + info.begin).clone()
                 if count else torch.empty(0, dtype=dtype))  # (clone: aligned, apart from the blob)
            tensors[name] = t.reshape(info.shape).to(device)
        kv = {int(name.split(".")[1]): (tensors[name], tensors[name[:-1] + "v"])
              for name in tensors if name.startswith("kv.") and name.endswith(".k")}
        kept = []
        for e in json.loads(meta[ENTRIES_KEY]):
            gdn = {int(layer): (tensors[s], tensors[w]) for layer, (s, w) in e["gdn"].items()}
            k = Kept(tuple(_unplain(e["tokens"], tensors)), RecurrentSnapshot(int(e["pos"]), gdn, int(e["rope_delta"])),
                     {_unplain(key, {}): _unplain(snap, tensors) for key, snap in e["drafts"]})
            if k.trunk.pos != len(k.tokens) - 1 or any(t.shape[1] < k.trunk.pos for pair in kv.values() for t in pair):
                raise ValueError("a kept state's position is not its tokens' or past its K/V rows")
            kept.append(k)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        raise StateFileError(f"{path}: malformed ({e})") from None
    extra = {k.removeprefix(EXTRA_PREFIX): v for k, v in meta.items() if k.startswith(EXTRA_PREFIX)}
    return StateFile(kept, kv, extra)


def file_name(tokens: tuple) -> str:
    """A kept state's file in a state directory: named by its tokens."""
    return hashlib.sha256(json.dumps(_plain(list(tokens), {}, "")).encode()).hexdigest()[:32] + SUFFIX


# ---- a server's state directory -----------------------------------------------------------------


class StateDir:
    """`serve.state_dir`: every state the prefix cache keeps, also a file here (one per state,
    written by a thread of its own off the engine's step), at most `bound` bytes of them (the
    oldest by mtime go first; a state used again is touched). `load_into` fills a prefix cache
    from the files at start."""

    def __init__(self, path: Path, bound: int, stamp: Stamp, device: torch.device, say: Callable[[str], None]):
        self.path, self.bound, self.stamp, self.device, self.say = path, bound, stamp, device, say
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)  # (conversations' states: this user's alone)
        except OSError as e:
            raise TurboError(f"config: serve.state_dir={path}: cannot be made a directory ({e.strerror})") from None
        for tmp in path.glob(f".*{SUFFIX}.*.tmp"):  # a write a crash cut short
            tmp.unlink(missing_ok=True)
        self.written: dict[str, frozenset] = {}  # file name -> the drafter keys it holds
        self.said: set[str] = set()
        self.lock = threading.Lock()
        # what the writer has yet to do: (file name, the state or None to touch it, its K/V rows)
        self.queue: queue.Queue[tuple[str, Kept | None, dict] | None] = queue.Queue(QUEUED)
        self.thread = threading.Thread(target=self._run, name="turbo-state-files", daemon=True)
        self.thread.start()

    def load_into(self, cache: StateCache) -> int:
        """The files that still match into `cache`, newest first while they fit its budget (the
        newest the most recently used); each one refused is removed, each one line through `say`.
        Returns how many were loaded."""
        chosen, room = [], cache.budget
        for _, size, p in sorted(self._files(), key=lambda f: f[0], reverse=True):
            if size > room:
                self.say(f"{p}: not loaded (the prefix cache's serve.cache_gb is full)")
                continue
            room -= size
            chosen.append(p)
        loaded = 0
        for p in reversed(chosen):
            try:
                f = read_states(p, self.stamp, self.device)
            except StateFileError as e:
                self.say(f"{e}; removed")
                p.unlink(missing_ok=True)
                continue
            for k in f.kept:
                put(cache, k, f.kv)
                self.written[p.name] = frozenset(k.drafts)
            loaded += 1
        return loaded

    def kept(self, entry: Entry) -> None:
        """StateCache.on_keep: `entry` kept or used (on the engine's thread: a copy of its references
        is queued, the file written on the writer's)."""
        if entry.trunk is None or entry.kv is None:
            return  # (a live state's: not a copy this directory keeps)
        try:
            name = file_name(entry.tokens)
        except _Unplain:
            return  # (tokens no file can name: kept in memory only)
        with self.lock:
            same = self.written.get(name) == frozenset(entry.drafts)
        try:  # (never a wait on the engine's thread: past QUEUED, a state stays in memory only)
            self.queue.put_nowait((name, None, {}) if same else (name, kept_of(entry), dense_kv(entry)))
        except queue.Full:
            self._say_once(f"{self.path}: the writes fall behind the prefix cache; some states are not written")

    def close(self) -> None:
        """What is queued written, then the writer stops."""
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            name, kept, kv = item
            path = self.path / name
            try:
                if kept is None:
                    os.utime(path)  # (LRU by mtime: a state used again)
                    continue
                for note in write_states(path, self.stamp, [kept], kv):
                    self._say_once(note)
                with self.lock:
                    self.written[name] = frozenset(kept.drafts)
                self._prune()
            except FileNotFoundError:  # (touched after it was pruned: written again when next kept)
                with self.lock:
                    self.written.pop(name, None)
            except (OSError, TurboError) as e:
                with self.lock:
                    self.written.pop(name, None)
                self._say_once(f"{path}: not written ({getattr(e, 'strerror', None) or e})")

    def _prune(self) -> None:
        """The oldest files (by mtime) removed while the directory holds more than `bound` bytes."""
        files = self._files()
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.bound:
                break
            p.unlink(missing_ok=True)
            total -= size
            with self.lock:
                self.written.pop(p.name, None)

    def _files(self) -> list[tuple[int, int, Path]]:
        """The directory's state files: (mtime in ns, size, path); one removed meanwhile is not one."""
        files = []
        for p in self.path.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, st.st_size, p))
        return files

    def _say_once(self, line: str) -> None:
        if line not in self.said:
            self.said.add(line)
            self.say(line)

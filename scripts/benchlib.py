"""What the benchmarks in scripts/ share: a worker that opens one system (turbo, transformers,
llama.cpp) in a fresh process and times its load, prefill and greedy decode; the driver that
runs workers rep after rep, interleaved; the quiet-machine guard every timed repetition runs
under (`Guard`); where results are written (`results_path`: docs/results/<tool>-YYYY-MM-DD.*);
and small timing and formatting helpers.

    python -m scripts.benchlib '{"system": "turbo", "path": "...", ...}'   # one worker (a Spec as JSON)
    python -m scripts.benchlib --quiet-check [THREADS]    # what the quiet-machine guard sees now

The worker takes paths, not shape names, and imports only torch and the system it runs, so a
turbo from another checkout (PYTHONPATH=/that/checkout) runs in it as well as this one.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

VOCAB_IDS = 4096  # prompt ids below the shapes' tokenizer size (the GGUF's vocab is the tokenizer's)
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


# ---- where results go -----------------------------------------------------------------------


def results_path(tool: str, suffix: str = ".jsonl", fresh: bool = False, day: str | None = None) -> Path:
    """Where a benchmark writes its results unless its --out names a file:
    docs/results/<tool>-YYYY-MM-DD<suffix>, the date today's (UTC), docs/results/ made if missing.
    JSON lines are appended there, so one day's invocations of a tool make one table; with `fresh`
    (a file written whole, or a folder: suffix "") the first name not taken: <tool>-DATE, then
    <tool>-DATEb, <tool>-DATEc, ... A table in docs/benchmarks.md names the file it was made from."""
    day = day or time.strftime("%Y-%m-%d", time.gmtime())
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{tool}-{day}{suffix}"
    for letter in "bcdefghijklmnopqrstuvwxyz":
        if not (fresh and path.exists()):
            break
        path = RESULTS / f"{tool}-{day}{letter}{suffix}"
    return path


# ---- measurements inside a worker -----------------------------------------------------------


def status(key: str) -> int:
    """A /proc/self/status field in bytes."""
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith(key)).split()[1])


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def prompt_ids(n: int) -> list[int]:
    return torch.randint(3, VOCAB_IDS, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def top2_gap(logits) -> tuple[int, float]:
    top = torch.as_tensor(logits).float().topk(2)
    return int(top.indices[0]), float(top.values[0] - top.values[1])


def moe_step_bytes(a, elem: int = 2) -> tuple[int, int, int]:
    """Weight bytes one decode step reads (`elem` bytes a weight): (the MoE trunk's -- the
    router, top_k experts and the shared expert per routed layer -- and a dense trunk's of the
    same active size; then the bytes of all the stored experts). The mixers, the head and one
    embedding row are common to both."""
    h, kd, vd = a.hidden, a.lin_k_heads * a.lin_k_dim, a.lin_v_heads * a.lin_v_dim
    gdn = (2 * kd + 2 * vd + 2 * a.lin_v_heads) * h + h * vd
    attn = (2 * a.num_heads + 2 * a.num_kv_heads) * a.head_dim * h + h * a.num_heads * a.head_dim
    common = sum(gdn if a.is_gdn(i) else attn for i in range(a.num_layers)) + a.vocab * h + h
    active = a.experts_per_token * a.moe_intermediate + a.shared_intermediate
    routed = a.num_experts * h + 3 * h * active + (h if a.shared_intermediate else 0)
    moe = common + len(a.moe_layers) * routed
    dense = common + len(a.moe_layers) * 3 * h * active
    stored = len(a.moe_layers) * a.num_experts * 3 * h * a.moe_intermediate
    return moe * elem, dense * elem, stored * elem


class Turbo:
    def __init__(self, install: str, threads: int, kv_cache: str | None, dtype: str | None):
        import turbo

        # (options only when asked: a baseline checkout may predate them)
        opts = {k: v for k, v in (("kv_cache", kv_cache), ("dtype", dtype)) if v}
        self.rt = turbo.open(install, threads=threads, **opts)
        self.trunk = self.rt.trunk

    def prefill(self, ids: list[int], new: int):
        self.st = self.trunk.new_state(len(ids) + new + 1)
        return self.trunk.prefill(self.st, ids).logits[-1]

    def decode(self, token: int):
        return self.trunk.step(self.st, [token], (), None).logits[-1]

    def bytes_per_token(self, context: int) -> int:
        """What one decode step reads: every matrix once (the lm_head too), the cached K/V of
        `context` positions, and each GDN state (read and written)."""
        mats = sum(getattr(m, "data", m).nbytes for m in self.trunk.matrices())  # (QuantizedWeight: no .data)
        kv = sum(2 * k[:, :context].nbytes for k, _ in self.st.kv.values())
        gdn = sum(2 * s.nbytes for s, _ in self.st.gdn.values())
        return mats + kv + gdn

    def release(self) -> None:
        del self.st


class Transformers:
    def __init__(self, checkpoint: str, threads: int):
        from transformers import AutoModelForCausalLM  # optional benchmark dependency

        torch.set_num_threads(threads)
        # the checkpoint's own dtype: bf16 for the published shapes, fp32 for tiny
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto").eval()

    def prefill(self, ids: list[int], new: int):
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)  # as generate
        self.past = out.past_key_values
        return out.logits[0, -1]

    def decode(self, token: int):
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([[token]]), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[0, -1]

    def release(self) -> None:
        del self.past


# environment: llama.cpp without its extra buffer types (use_extra_bufts off), where they crash
# (llama-cpp-python 0.3.36 on this AMX VM: ggml's AMX path faults on the first quantized
# prefill; LLAMA_CPP_LIB_PATH=<scripts/build_llamacpp.py --no-amx's bin> keeps repacking on
# without it, docs/llamacpp.md)
LLAMA_PLAIN = "TURBO_LLAMA_PLAIN"


def _plain(params):
    params.use_extra_bufts = False
    return params


# environment: llama.cpp's flash attention on (=1) in the binding, whose default is off
# (llama-bench's and llama-server's default, auto, turns it on for the CPU)
LLAMA_FLASH_ATTN = "TURBO_LLAMA_FLASH_ATTN"


class LlamaCpp:
    def __init__(self, gguf: str, threads: int, n_ctx: int):
        import llama_cpp.llama as lib  # optional benchmark dependency (pip install llama-cpp-python)

        if os.environ.get(LLAMA_PLAIN):  # weight repacking (CPU repack / AMX buffers) off, see LLAMA_PLAIN
            default = lib.llama_cpp.llama_model_default_params
            lib.llama_cpp.llama_model_default_params = lambda: _plain(default())
        self.llm = lib.Llama(model_path=gguf, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                             n_threads_batch=threads, flash_attn=os.environ.get(LLAMA_FLASH_ATTN) == "1",
                             verbose=False)

    def _logits(self):
        import numpy as np  # (llama_cpp's own dependency)

        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),)).copy()

    def prefill(self, ids: list[int], new: int):
        self.llm.reset()
        self.llm.eval(ids)
        return self._logits()

    def decode(self, token: int):
        self.llm.eval([token])
        return self._logits()

    def release(self) -> None:
        self.llm.reset()


@dataclass
class Spec:
    """One worker's task: `system` (turbo, transformers or llama.cpp) opened from `path` (an
    install, an HF checkpoint, a GGUF), then per prompt length a prefill and `new` decode steps."""

    system: str
    path: str
    threads: int
    prompts: list[int]
    new: int
    kv_cache: str | None = None
    dtype: str | None = None
    env: dict = field(default_factory=dict)  # extra environment (PYTHONPATH of a baseline checkout)


def work(spec: Spec) -> dict:
    """Load time and peak RSS while loading, RSS after it; per prompt length n: prefill tok/s and
    the peak RSS during it, then greedy decode tok/s at context n with its tokens and each step's
    top-2 logit gap. Peak RSS is VmHWM, reset (/proc/self/clear_refs 5) as each phase starts."""
    reset_peak()
    t0 = time.perf_counter()
    if spec.system == "llama.cpp":
        sut = LlamaCpp(spec.path, spec.threads, max(spec.prompts) + spec.new + 8)
    elif spec.system == "transformers":
        sut = Transformers(spec.path, spec.threads)
    else:
        sut = Turbo(spec.path, spec.threads, spec.kv_cache, spec.dtype)
    rec = {"load_s": time.perf_counter() - t0, "load_peak": status("VmHWM"), "load_rss": status("VmRSS")}
    # as turbo's CLI and server do once the runtime is open (every system alike): what lives as
    # long as the process is left out of the collector's full walks, ~100 ms each with torch loaded
    gc.freeze()
    if isinstance(sut, Turbo):
        rec["step"] = sut.trunk.step_name
        if getattr(sut.trunk.arch, "moe_layers", None):
            rec["moe_step_bytes"] = moe_step_bytes(sut.trunk.arch)
    for n in spec.prompts:
        ids = prompt_ids(n)
        reset_peak()
        t0 = time.perf_counter()
        logits = sut.prefill(ids, spec.new)
        prefill_s = time.perf_counter() - t0
        prefill_peak = status("VmHWM")
        tokens, gaps = [], []
        t0 = time.perf_counter()
        for _ in range(spec.new):
            token, gap = top2_gap(logits)
            tokens.append(token)
            gaps.append(gap)
            logits = sut.decode(token)
        decode_s = time.perf_counter() - t0
        rec[str(n)] = {"prefill_tps": n / prefill_s, "prefill_peak": prefill_peak, "decode_tps": spec.new / decode_s,
                       "decode_peak": status("VmHWM"), "tokens": tokens, "gaps": gaps}
        if isinstance(sut, Turbo):
            rec[str(n)]["bytes_per_token"] = sut.bytes_per_token(n + spec.new // 2)
        sut.release()
    return rec


# ---- the quiet-machine guard ----------------------------------------------------------------
#
# A figure timed beside a co-tenant is not a result: on 2 cores one other busy thread halves a
# 2-thread benchmark, and llama.cpp's spin-waiting thread pool loses far more than that. So
# every timed repetition runs under `Guard.rep()`:
#
# - before it, the guard samples the machine over `window` seconds: the CPUs other processes
#   kept busy (/proc/stat's busy time of all CPUs, less what this process tree used -- between
#   repetitions the benchmark is idle, so that is everyone else) and the 1-minute load average.
#   Quiet is others <= max_others CPUs and load1 <= max_load. It waits (`poll` s between
#   samples) until quiet, at most `max_wait` s; past that the repetition runs anyway, marked
#   disturbed (so a busy machine ends the run in bounded time, and the record shows why).
# - during it, the same difference over the repetition's whole wall time: a co-tenant that
#   started mid-repetition marks it disturbed too.
#
# Thresholds (TURBO_BENCH_* in the environment override them):
# - max_others 0.15 CPUs (TURBO_BENCH_MAX_OTHERS): an idle VM's daemons and kernel threads use a
#   few hundredths of a CPU; one co-tenant thread (a build, a test, another engineer's shell loop)
#   is ~1. Steal time counts as busy: a hypervisor taking the CPU disturbs as much as a process.
# - max_load threads + 0.5 (TURBO_BENCH_MAX_LOAD): the load average lags by a minute, so it still
#   holds the benchmark's own previous repetition (up to its `threads`); more than half a
#   runnable task beyond that is someone else's recent work, which the short window can miss
#   when it comes in bursts (a test suite between files).
# - max_wait 300 s (TURBO_BENCH_MAX_WAIT): the load average decays with a 1-minute time
#   constant, so from 4 to 2.5 takes ~30 s after a co-tenant stops; five minutes lets a build
#   step or a test file finish.
# TURBO_BENCH_GUARD=off: never wait, keep every repetition (still sampled and recorded) -- for
# smoke runs on a busy machine, whose figures are not results.

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Counters:
    """Cumulative counters at one instant: `busy` CPU-seconds all CPUs spent busy since boot,
    `own` CPU-seconds this process tree used (live members and their reaped children), the
    1-minute load average, and `t` monotonic seconds."""

    t: float
    busy: float
    own: float
    load1: float


def _tree_ticks(root: int) -> int:
    """utime + stime + cutime + cstime of `root` and every live descendant: a child that exits
    moves its time into its parent's cutime / cstime, so the sum stays continuous."""
    parent, ticks = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        except OSError:  # (exited while listed)
            continue
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        ticks[pid] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    total = 0
    for pid, t in ticks.items():
        p = pid
        while p > 1 and p != root:
            p = parent.get(p, 0)
        total += t if p == root else 0
    return total


def read_counters() -> Counters:
    """The machine's counters now (Linux /proc)."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
    busy = sum(cpu[:8]) - cpu[3] - cpu[4]
    return Counters(time.monotonic(), busy / CLK_TCK, _tree_ticks(os.getpid()) / CLK_TCK, os.getloadavg()[0])


def others_cpus(a: Counters, b: Counters) -> float:
    """CPUs (0..cores) other processes kept busy on average from `a` to `b`."""
    return max(0.0, (b.busy - a.busy) - (b.own - a.own)) / max(b.t - a.t, 1e-9)


@dataclass
class RepGuard:
    """What the guard saw around one repetition (filled as it runs; `asdict` is its record)."""

    quiet_before: bool = True
    waited_s: float = 0.0
    load1_before: float = 0.0
    others_before: float = 0.0
    others_during: float = 0.0
    load1_after: float = 0.0
    disturbed: bool = False
    guard_on: bool = True  # False: TURBO_BENCH_GUARD=off, nothing dropped (a smoke run, not a result)


@dataclass
class Guard:
    threads: int = 2  # the benchmark's own threads (its share of the lagging load average)
    max_others: float = 0.15
    max_load: float | None = None  # None: threads + 0.5
    max_wait: float = 300.0
    window: float = 0.5
    poll: float = 2.0
    enabled: bool = True
    counters: Callable[[], Counters] = read_counters
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        if self.max_load is None:
            self.max_load = self.threads + 0.5

    @classmethod
    def from_env(cls, threads: int, **kw) -> "Guard":
        """A guard with the TURBO_BENCH_* overrides (the comment above `Counters`)."""
        env = os.environ
        for key, name in (("max_others", "TURBO_BENCH_MAX_OTHERS"), ("max_load", "TURBO_BENCH_MAX_LOAD"),
                          ("max_wait", "TURBO_BENCH_MAX_WAIT")):
            if env.get(name):
                kw[key] = float(env[name])
        kw.setdefault("enabled", env.get("TURBO_BENCH_GUARD", "on") != "off")
        return cls(threads=threads, **kw)

    def sample(self) -> tuple[float, float]:
        """(others' CPUs over one window, the load average after it)."""
        a = self.counters()
        self.sleep(self.window)
        b = self.counters()
        return others_cpus(a, b), b.load1

    def quiet(self, others: float, load1: float) -> bool:
        return others <= self.max_others and load1 <= self.max_load

    def wait_quiet(self, g: RepGuard) -> None:
        """Sample until quiet or past max_wait (`g` says which, and what was seen)."""
        start = self.counters().t
        while True:
            g.others_before, g.load1_before = self.sample()
            g.waited_s = self.counters().t - start
            g.quiet_before = self.quiet(g.others_before, g.load1_before)
            if g.quiet_before or not self.enabled or g.waited_s >= self.max_wait:
                return
            self.sleep(self.poll)

    @contextlib.contextmanager
    def rep(self, label: str = "") -> Iterator[RepGuard]:
        """Around one timed repetition: wait for a quiet machine, then time the body, then mark
        the repetition disturbed if it started loud or others used the CPUs while it ran."""
        g = RepGuard(guard_on=self.enabled)
        self.wait_quiet(g)
        if not g.quiet_before:
            print(f"guard{' ' + label if label else ''}: not quiet after {g.waited_s:.0f} s (others "
                  f"{g.others_before:.2f} CPUs, load {g.load1_before:.2f}): "
                  + ("disturbed" if self.enabled else "guard off, kept"), file=sys.stderr)
        a = self.counters()
        yield g
        b = self.counters()
        g.others_during, g.load1_after = others_cpus(a, b), b.load1
        g.disturbed = self.enabled and not (g.quiet_before and g.others_during <= self.max_others)
        if self.enabled and g.quiet_before and g.disturbed:
            print(f"guard{' ' + label if label else ''}: others used {g.others_during:.2f} CPUs during it: disturbed",
                  file=sys.stderr)


# A controlled co-tenant (how each system behaves beside one is a row of its own, not a speed
# ratio): `n` processes each keeping one CPU busy with a Python spin loop (the CPU taken, little
# memory traffic), at the benchmark's priority. They are this process's children, so the guard
# counts their CPU as the benchmark's own (its load threshold takes their n) and still catches
# anyone else.
COTENANT = "while True:\n    pass"


@contextlib.contextmanager
def cotenant(n: int) -> Iterator[list[subprocess.Popen]]:
    procs = [subprocess.Popen([sys.executable, "-c", COTENANT]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def kept(records: list[dict]) -> list[dict]:
    """The records of undisturbed repetitions (a record without a guard's is kept: older runs)."""
    return [r for r in records if not (r.get("guard") or {}).get("disturbed")]


def provenance() -> str:
    """When, on which commit of this checkout, and by which command a table was made."""
    root = Path(__file__).resolve().parent.parent
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = " (+ uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"run: {when}, commit {commit}{dirty}: python {shlex.join(sys.argv)}"


def guard_summary(records: list[dict]) -> str:
    """Two lines for a table: repetitions kept / dropped and the machine's load around them; then
    `provenance()`."""
    gs = [r["guard"] for r in records if "guard" in r]
    if not gs:
        return f"{len(records)} repetitions, no guard record\n{provenance()}"
    dropped = sum(g["disturbed"] for g in gs)
    loads = [g["load1_before"] for g in gs] + [g["load1_after"] for g in gs]
    others = [g["others_during"] for g in gs]
    off = "guard OFF (TURBO_BENCH_GUARD=off: a smoke run, not a result), " if not all(
        g.get("guard_on", True) for g in gs) else ""
    return (f"{off}guard: kept {len(records) - dropped} of {len(records)} repetitions, dropped {dropped} (disturbed); "
            f"load average {min(loads):.2f}-{max(loads):.2f}, others' CPUs during a repetition "
            f"<= {max(others):.2f}, waited <= {max(g['waited_s'] for g in gs):.0f} s\n{provenance()}")


# ---- the driver -----------------------------------------------------------------------------


def warm_page_cache(path: Path) -> None:
    """Read the weights' files once (a turbo install's or a checkpoint's safetensors, a GGUF) so
    that a system's steps map pages from memory, as on a machine that has run it before: many
    installs in one run exceed the page cache, and a step faulting its pages in from disk
    measures the disk."""
    for f in ([path] if path.is_file() else sorted(path.rglob("*.safetensors"))):
        with f.open("rb", buffering=0) as fh:
            while fh.read(1 << 24):
                pass


def run(specs: dict[str, Spec], reps: int, timeout: float, out: Path | None = None,
        guard: Guard | None = None, cotenants: int = 0) -> list[dict]:
    """Every system's worker once per repetition, each in a fresh process, one after another
    (A, B, C, A, B, C, ...), its weights read into the page cache first, under the quiet-machine
    guard (default: Guard.from_env with the specs' threads and the co-tenants): its record, with
    `system`, `rep`, `guard` (RepGuard's fields) and `cotenants`, appended to `out` (JSON lines)
    and returned -- disturbed ones too, for the record; tables take `kept(records)`. With
    `cotenants`, that many controlled co-tenants (`cotenant`) run beside each worker. A worker
    over `timeout` seconds is left out; one that fails ends the run."""
    guard = guard or Guard.from_env(max(s.threads for s in specs.values()) + cotenants)
    records = []
    for rep in range(reps):
        for name, spec in specs.items():
            warm_page_cache(Path(spec.path))  # (before the guard: reading the files is not the machine's noise)
            # (this file, not `-m scripts.benchlib`: the worker imports nothing beside it, and a
            # spec's PYTHONPATH picks the turbo it runs)
            cmd = [sys.executable, __file__, json.dumps(asdict(spec))]
            try:
                with guard.rep(f"rep {rep} {name}") as g, cotenant(cotenants):
                    done = subprocess.run(cmd, env=dict(os.environ, **spec.env), capture_output=True, text=True,
                                          timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"rep {rep} {name}: over {timeout} s, left out", file=sys.stderr)
                continue
            if done.returncode != 0:
                raise SystemExit(f"{name}: {done.stderr.strip()[-2000:]}")
            rec = json.loads(done.stdout.strip().splitlines()[-1])
            rec |= {"system": name, "rep": rep, "threads": spec.threads, "guard": asdict(g), "cotenants": cotenants}
            if out is not None:
                with out.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
            print(f"rep {rep} {name}{' (disturbed)' if g.disturbed else ''}: load {rec['load_s']:.2f} s, "
                  + ", ".join(f"{n}: prefill {rec[str(n)]['prefill_tps']:.1f}, decode {rec[str(n)]['decode_tps']:.1f}"
                              for n in spec.prompts), file=sys.stderr)
            records.append(rec)
    return records


# A plain streaming read, as a decode step's products read their weights: each thread sums its
# contiguous share of a buffer larger than the caches in four independent vector chains. torch has
# no such probe (its GEMV reads at half the memory's speed here, its reductions at ~3/4).
_READ_PROBE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef long long v4 __attribute__((vector_size(32)));
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
double read_gbs(long bytes, int threads, int reps, long long *sink) {
    char *buf = aligned_alloc(64, (size_t)bytes);
    if (!buf) return -1.0;
    memset(buf, 1, (size_t)bytes);
    double best = 0.0, times[64];
    for (int rep = 0; rep < reps && rep < 64; rep++) {
        double t0 = now();
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int id = 0; id < threads; id++) {
            const v4 *p = (const v4 *)(buf + bytes / threads * id), *end = (const v4 *)(buf + bytes / threads * (id + 1));
            v4 a = {0}, b = {0}, c = {0}, d = {0};
            for (; p + 4 <= end; p += 4) { a += p[0]; b += p[1]; c += p[2]; d += p[3]; }
            v4 s = a + b + c + d;
            sink[id] = s[0] + s[1] + s[2] + s[3];
        }
        times[rep] = now() - t0;
    }
    for (int i = 0; i < reps && i < 64; i++) best = best > bytes / times[i] ? best : bytes / times[i];
    free(buf);
    return best / 1e9;
}
"""


def bandwidth(threads: int) -> float:
    """GB/s a plain streaming read of 1 GB reaches with `threads` threads (_READ_PROBE, compiled
    once with the host's compiler: -O3 -march=native -fopenmp), the best of 7; torch's reduction
    (about 3/4 of it) where no compiler is found."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        torch.set_num_threads(threads)
        w = torch.ones(1 << 28)
        w.amax()
        t0 = time.perf_counter()
        w.amax()
        return w.nbytes / (time.perf_counter() - t0) / 1e9
    cache = Path.home() / ".cache" / "turbo" / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"read_probe-{hashlib.sha256(_READ_PROBE.encode()).hexdigest()[:16]}.so"
    if not lib.is_file():
        src = lib.with_suffix(".c")
        src.write_text(_READ_PROBE)
        tmp = lib.with_suffix(".tmp")
        subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(tmp)],
                       check=True, capture_output=True)
        tmp.rename(lib)
    probe = ctypes.CDLL(str(lib))
    probe.read_gbs.restype = ctypes.c_double
    probe.read_gbs.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    sink = (ctypes.c_longlong * max(threads, 1))()
    return probe.read_gbs(1 << 30, threads, 7, sink)


# ---- timing and formatting ------------------------------------------------------------------


def med(values: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    """The median with [min, max]."""
    v = [x / scale for x in values]
    return f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}, {fmt.format(max(v))}]"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def timed(fn, reps: int) -> float:
    """Seconds per call of `fn`, over `reps` calls after a warm-up call."""
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def step_times(rt, prompt: list[int], rows: list[int], calls: int) -> dict:
    """Seconds of a one-row decode step, and of R-row verifies (plain, keeping checkpoints)."""
    trunk = rt.trunk
    st = trunk.new_state(len(prompt) + 64)
    trunk.prefill(st, prompt)
    pos = st.pos

    def step(n: int, rollback: str | None):
        trunk.step(st, prompt[:n], (), rollback)
        st.pos = pos  # back to the anchor (attention positions are overwritten next time)

    out = {"decode": timed(lambda: step(1, None), calls)}
    for n in rows:
        out[n, None] = timed(lambda: step(n, None), calls)
        out[n, "checkpoint"] = timed(lambda: step(n, "checkpoint"), calls)
    return out


def quiet_check(threads: int = 2, samples: int = 5) -> None:
    """Print what the guard sees now, a sample a second: the check before a comparison."""
    guard = Guard.from_env(threads)
    for _ in range(samples):
        others, load1 = guard.sample()
        print(f"others {others:.2f} CPUs, load {load1:.2f}: {'quiet' if guard.quiet(others, load1) else 'NOT quiet'} "
              f"(thresholds: others <= {guard.max_others}, load <= {guard.max_load})")
        time.sleep(0.5)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
    elif sys.argv[1] == "--quiet-check":  # python -m scripts.benchlib --quiet-check [THREADS]
        quiet_check(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    else:
        print(json.dumps(work(Spec(**json.loads(sys.argv[1])))))

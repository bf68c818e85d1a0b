"""Building the native CPU library (native*.c) once per machine with the host's C compiler:
the build's key, its private per-user cache directory (`untrusted` says why one must not be
loaded from), the compile into a temporary file renamed into place whole (so parallel jobs never
load a half-written file; Ctrl-C or SIGTERM leave nothing), and the one line a build says first
(`announcing` sends it elsewhere, e.g. the TUI's status). Loading it: native_lib.py.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ..errors import TurboError

# the library's parts (native.c, native_products.c, ...), built into one library
SOURCES = sorted(Path(__file__).parent.glob("native*.c"))
HEADERS = sorted(Path(__file__).parent.glob("native*.h"))  # what they share (native.h, native_internal.h)
# No -ffast-math: the row-stability argument in native.c needs sums in program order.
# -fopenmp: the library then shares the libgomp torch has loaded (native.c, set_threads).
FLAGS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])

# The x86 ISA tiers the library builds for (TURBO_ISA; default: the best this CPU has), so one
# machine builds, tests and measures what a CPU of each tier runs: the -march flags, and the
# /proc/cpuinfo flags a CPU needs to run them. avx2 is what AMD Zen 2/3 and Intel client CPUs
# since Alder Lake have (AVX2 + FMA + F16C); avx512 is the native ISA less AMX; amx the native one.
ISA_ENV = "TURBO_ISA"
NO_AMX = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
TIERS: dict[str, tuple[list[str], frozenset[str]]] = {
    "avx2": (["-march=haswell"], frozenset({"avx2", "fma", "f16c"})),
    "avx512": (["-march=native", *NO_AMX], frozenset({"avx512f", "avx512bw", "avx512vl"})),
    "amx": (["-march=native"], frozenset({"amx_tile", "amx_bf16", "avx512f", "avx512bw"})),
}


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def best_tier(flags: frozenset[str]) -> str | None:
    """The best tier a CPU with `flags` runs (None: not x86, or below AVX2: the native flags)."""
    return next((t for t in ("amx", "avx512", "avx2") if TIERS[t][1] <= flags), None)


def isa_tier() -> str | None:
    """The tier to build: TURBO_ISA, refused by name where this CPU cannot run it, else the best."""
    flags = cpu_flags()
    want = os.environ.get(ISA_ENV, "").strip().lower()
    if not want:
        return best_tier(flags)
    if want not in TIERS:
        raise TurboError(f"{ISA_ENV}={want!r}: expected one of {', '.join(TIERS)} (or unset: the best this CPU has)",
                         field=ISA_ENV)
    if missing := sorted(TIERS[want][1] - flags):
        raise TurboError(f"{ISA_ENV}={want}: this CPU lacks {', '.join(missing)} (expected a tier it runs: "
                         f"{', '.join(t for t in TIERS if TIERS[t][1] <= flags) or 'none'})", field=ISA_ENV)
    return want


def tier_flags(tier: str | None) -> tuple[list[str], ...]:
    """The compile flags to try in order for `tier` (None: FLAGS, the native ISA)."""
    if tier is None:
        return FLAGS
    march = TIERS[tier][0]
    return (["-O3", *march, "-fopenmp"], ["-O3", *march])

# what the first build's line says it takes: measured cold, 35 s on a quiet 2-core VM (cc 12; most
# of it the matrix products, then all in native_products.c), 66 s on a busy one
BUILD_TIME = "about half a minute"


def _key(cc: str, tier: str | None = None) -> str:
    """The build's key: the sources, the tier and its flags, the compiler and the machine."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    return hashlib.sha256(b"".join(src.read_bytes() for src in [*SOURCES, *HEADERS])
                          + f"{tier} {tier_flags(tier)}".encode()
                          + version.encode() + platform.machine().encode() + platform.node().encode()).hexdigest()[:16]


def untrusted(path: Path) -> str | None:
    """Why `path` (a cache directory or a library in it) must not be loaded from: another user's,
    or writable by others (who could then plant a library that runs in this process)."""
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not this user's {os.getuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def build(cc: str, cache_dir: Path | None, tier: str | None = None) -> tuple[Path, Path | None]:
    """The library's path, built for ISA `tier` (isa_tier(); None: the native flags), and a
    throwaway directory to remove once it is loaded (None when it is cached). A cache directory
    is created 0700 and, like a cached library, used only when untrusted() finds nothing;
    otherwise the next one, the last a fresh private directory."""
    key = _key(cc, tier)
    errors: list[str] = []
    for dest_dir in (cache_dir or Path.home() / ".cache" / "turbo", Path(tempfile.gettempdir()) / "turbo-native", None):
        fresh = dest_dir is None
        try:
            if fresh:
                dest_dir = Path(tempfile.mkdtemp(prefix="turbo-native-"))
            dest_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if problem := untrusted(dest_dir):
                errors.append(problem)
                continue
            target = dest_dir / f"native-{key}.so"
            if target.exists() and untrusted(target) is None:
                return target, None
            _announce(f"compiling turbo's CPU kernels (native*.c) with {cc}: {BUILD_TIME}, once per "
                      + (f"process; not cached ({errors[-1]})" if fresh else f"machine; cached in {dest_dir}"))
            with _terminate_raises():
                for flags in tier_flags(tier):
                    error = _compile(cc, flags, dest_dir / f"tmp-native-{key}-{os.getpid()}.so", target)
                    if error is None:
                        return target, dest_dir if fresh else None
                    errors.append(error)
        except OSError as e:
            errors.append(str(e))
        if fresh and dest_dir is not None:
            shutil.rmtree(dest_dir, ignore_errors=True)
    raise RuntimeError(f"{cc} could not build {' '.join(s.name for s in SOURCES)}: "
                       f"{errors[-1] if errors else 'unknown'}")


def _compile(cc: str, flags: list[str], tmp: Path, target: Path) -> str | None:
    """Compile into `tmp`, renamed to `target` whole; None, or the compiler's last line. `tmp`
    is gone afterwards whatever happens (a failure, Ctrl-C, SIGTERM: see _terminate_raises)."""
    try:
        done = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", str(tmp), *map(str, SOURCES), "-lm"],
                              capture_output=True, text=True)
        if done.returncode == 0:
            os.chmod(tmp, 0o755)  # not group-writable whatever the umask: untrusted() would refuse it
            os.replace(tmp, target)
            return None
        return (done.stderr.strip().splitlines() or ["failed"])[-1]
    finally:  # subprocess.run has killed and reaped the compiler on an exception
        tmp.unlink(missing_ok=True)


@contextmanager
def _terminate_raises() -> Iterator[None]:
    """SIGTERM (whose default ends the process at once, past every finally) raises SystemExit
    while the build runs, so its temporary file goes too; only in the main thread, and only
    over the default handler (a program's own handler is its to keep)."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


_announce: Callable[[str], None] = _to_stderr


@contextmanager
def announcing(to: Callable[[str], None]) -> Iterator[None]:
    """Within it the first build's line goes to `to` (the TUI's status line) instead of stderr."""
    global _announce
    before, _announce = _announce, to
    try:
        yield
    finally:
        _announce = before

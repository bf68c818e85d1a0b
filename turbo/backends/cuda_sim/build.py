"""Building the simulated device's native parts with g++, cached under ~/.cache/turbo/cuda_sim:
the runtime (runtime.cpp) and one host library per kernel source (shim.h + kernels_ptx/<m>.cu),
each keyed by the hash of everything that went into it (sources, flags, SHIM_VERSION)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNTIME_SRC = HERE / "runtime.cpp"
SHIM = HERE / "shim.h"
SHIM_VERSION = "2"  # bump when the meaning of a build changes without its inputs changing
CXX = "g++"
COMMON = ("-std=c++17", "-O2", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-fno-strict-aliasing")
# TSan instrumentation without its runtime: every access the compiler cannot prove local calls a
# __tsan_* hook that runtime.cpp defines (bounds checks and the byte counts of launch records)
INSTRUMENT = ("-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0", "-fno-plt")


def _cpu_has_fma() -> bool:
    try:
        return " fma " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


# fmaf as one instruction instead of a call into libm (the same correctly rounded result)
ARCH = ("-mfma",) if _cpu_has_fma() else ()


class BuildError(RuntimeError):
    """g++ is missing or refused a source: the message carries its first error lines."""


def cache_dir() -> Path:
    base = os.environ.get("TURBO_CUDA_SIM_CACHE")
    path = Path(base) if base else Path.home() / ".cache" / "turbo" / "cuda_sim"
    path.mkdir(parents=True, exist_ok=True)
    return path


def compiler_missing() -> str | None:
    return None if shutil.which(CXX) else f"the simulated device compiles kernels with {CXX}, which is not on PATH"


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()[:20]


def _run(cmd: list[str], what: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        lines = [ln for ln in res.stderr.splitlines() if "error" in ln][:5] or res.stderr.splitlines()[-5:]
        raise BuildError(f"building {what} for the simulated device failed: " + " | ".join(lines))


def _publish(tmp: Path, dest: Path) -> None:
    os.replace(tmp, dest)  # atomic: concurrent builders of one key race harmlessly


def runtime_library() -> Path:
    """The runtime's shared library, built on first use."""
    src = RUNTIME_SRC.read_bytes()
    key = _digest(src, SHIM_VERSION.encode(), " ".join(COMMON).encode())
    dest = cache_dir() / f"runtime-{key}.so"
    if not dest.is_file():
        missing = compiler_missing()
        if missing:
            raise BuildError(missing)
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            out = Path(tmp) / "runtime.so"
            _run([CXX, *COMMON, "-shared", str(RUNTIME_SRC), "-o", str(out), "-ldl"], "the runtime")
            _publish(out, dest)
    return dest


# `extern __shared__ T name[];` (the launch's dynamic shared memory) becomes a pointer to it
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+((?:__align__\s*\(\s*\d+\s*\)\s*)?)([\w:\s\*]+?)\s*(\w+)\s*\[\s*\]\s*;")


def host_source(cu_text: str) -> str:
    """The .cu text as the host build compiles it (dynamic shared memory rewritten)."""
    def repl(m: re.Match) -> str:
        depth = cu_text.count("{", 0, m.start()) - cu_text.count("}", 0, m.start())
        ctype, name = m.group(2).strip(), m.group(3)
        if depth > 0:
            return f"{ctype}* const {name} = reinterpret_cast<{ctype}*>(sim_dyn_smem());"
        return f"#define {name} (reinterpret_cast<{ctype}*>(sim_dyn_smem()))\n"
    return _EXTERN_SHARED.sub(repl, cu_text)


def _trampolines(entries: list[str]) -> str:
    # not instrumented: they read the parameter values the driver packed, not device memory
    head = r"""
#include <utility>
template <class... A, size_t... I>
__attribute__((no_sanitize_thread)) static void sim_call_i(void (*f)(A...), void** a, std::index_sequence<I...>) {
    f(*(A*)a[I]...);
}
template <class... A>
__attribute__((no_sanitize_thread)) static void sim_call(void (*f)(A...), void** a) {
    sim_call_i(f, a, std::index_sequence_for<A...>{});
}
// the C signature's parameter sizes, which the driver compares with the PTX entry's
template <class... A>
__attribute__((no_sanitize_thread)) static int sim_sizes(void (*)(A...), int* out) {
    int i = 0;
    ((out[i++] = (int)sizeof(A)), ...);
    return i;
}
"""
    return head + "".join(
        f'extern "C" __attribute__((no_sanitize_thread)) void sim_tramp_{e}(void** a) {{ sim_call({e}, a); }}\n'
        f'extern "C" int sim_sizes_{e}(int* out) {{ return sim_sizes({e}, out); }}\n'
        for e in entries)


def module_library(cu: Path, entries: list[str]) -> Path:
    """The host library of kernel source `cu` exporting `sim_tramp_<entry>` for each entry."""
    text = cu.read_text()
    shim = SHIM.read_text()
    body = host_source(text) + _trampolines(sorted(entries))
    key = _digest(shim.encode(), body.encode(), SHIM_VERSION.encode(), " ".join(COMMON + INSTRUMENT + ARCH).encode())
    dest = cache_dir() / f"{cu.stem}-{key}.so"
    if not dest.is_file():
        missing = compiler_missing()
        if missing:
            raise BuildError(missing)
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            src = Path(tmp) / f"{cu.stem}_sim.cpp"
            # the #line keeps g++'s messages and __LINE__ (barrier sites) in the .cu's own lines
            src.write_text(f'#include "{SHIM}"\n#line 1 "{cu}"\n' + host_source(text) + "\n#line 100000 \"sim\"\n"
                           + _trampolines(sorted(entries)))
            obj, out = Path(tmp) / "k.o", Path(tmp) / "k.so"
            _run([CXX, *COMMON, *INSTRUMENT, *ARCH, "-c", str(src), "-o", str(obj)], cu.name)
            # linked without -fsanitize: the hooks resolve to the runtime, loaded RTLD_GLOBAL first
            _run([CXX, "-shared", str(obj), "-o", str(out)], cu.name)
            _publish(out, dest)
    return dest


def load(path: Path, global_symbols: bool = False) -> ctypes.CDLL:
    mode = os.RTLD_NOW | (os.RTLD_GLOBAL if global_symbols else os.RTLD_LOCAL)
    return ctypes.CDLL(str(path), mode=mode)

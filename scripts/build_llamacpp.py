"""Build llama.cpp's own tools (llama-bench, llama-server, llama-cli) from the source that
llama-cpp-python's sdist vendors, as llama.cpp's users build them: CMake Release, its defaults
(GGML_NATIVE on: -march=native; GGML_CPU_REPACK on: Q4_0 / Q8_0 weights repacked at load).

    nice -n 19 python -m scripts.build_llamacpp [--version 0.3.36] [--jobs 2] [--binding]
    nice -n 19 python -m scripts.build_llamacpp --no-amx     # where ggml's AMX kernels fault (NO_AMX)
    nice -n 19 python -m scripts.build_llamacpp --tier avx2  # as built for an AVX2-only CPU (TIERS)

Into ~/.cache/turbo/llamacpp/<version>/ (--cache): the sdist and its source under src/, the
build under build/, the binaries in build/bin/ beside build-info.json (the CMake flags as
configured and as CMake resolved them, the compiler, the llama.cpp commit the sdist vendors,
`llama-bench --version`, the CPU). Idempotent: a build whose build-info.json is there is
reported, not rebuilt. --binding also installs the Python binding (pip install of the same
sdist, its own default CMake flags) when `llama_cpp` is missing or another version.

The sdist carries no .git, so llama.cpp's build-info would say "unknown": the commit is read
from the sdist's CHANGELOG ("update llama.cpp to ggml-org/llama.cpp@<commit>") and passed as
LLAMA_BUILD_COMMIT, which `llama-bench -o json` then reports as build_commit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
from pathlib import Path

DEFAULT_VERSION = "0.3.36"
DEFAULT_CACHE = Path.home() / ".cache" / "turbo" / "llamacpp"
TOOLS = ("llama-bench", "llama-server", "llama-cli", "llama-quantize")
# --no-amx: ggml's AMX kernels left out (explicit -mno-* flags win over -march=native's), the rest
# of the native ISA and the CPU repacking kept. On this development VM the CPU reports AMX and the
# kernel grants it, yet ggml's AMX path faults on the first quantized prefill (Q4_0: SIGSEGV in
# ggml_backend_amx_mul_mat; Q8_0: SIGILL), which the default build takes for Q4_0 / Q8_0 weights.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX = [f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"]
# --tier: llama.cpp built for one x86 ISA tier, as its users on such a CPU get it (GGML_NATIVE off,
# the tier's GGML_* options on), to compare with turbo's library built for the same tier (TURBO_ISA)
AVX2_TIER = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON"]
TIERS = {
    "native": [],
    "avx2": AVX2_TIER,
    "avx512": [*AVX2_TIER, "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"],
}
BIN_ENV = "TURBO_LLAMACPP_BIN"
FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # llama.cpp's default outside cross builds; explicit so the record says it
    "-DGGML_CPU_REPACK=ON",  # default: Q4_0 / Q8_0 repacked to the interleaved layouts at load
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # the server's web UI would be fetched from the network (none here) or built with npm; the
    # benchmark talks to its API only
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
]
# what CMakeCache.txt resolved, recorded beside the flags passed: the build type and compilers,
# and the CPU backend's options (not the GPU backends', all off)
RESOLVED = re.compile(r"^(CMAKE_BUILD_TYPE|CMAKE_C_COMPILER|CMAKE_CXX_COMPILER|CMAKE_C_FLAGS|CMAKE_CXX_FLAGS"
                      r"|CMAKE_C_FLAGS_RELEASE|CMAKE_CXX_FLAGS_RELEASE|BUILD_SHARED_LIBS|GGML_NATIVE|GGML_CPU\w*"
                      r"|GGML_AVX\w*|GGML_AMX\w*|GGML_F16C|GGML_FMA|GGML_BMI2|GGML_SSE42|GGML_OPENMP\w*|GGML_LLAMAFILE"
                      r"|GGML_BLAS|GGML_LTO|GGML_BACKEND_DL|GGML_AVAILABLE_BACKENDS|LLAMA_BUILD_COMMIT|LLAMA_OPENSSL)"
                      r":[A-Z]+=(.*)$")
# the instruction sets -march=native turns on here (ggml's CPU backend picks its kernels by these)
ISA = re.compile(r"#define __(AVX2|AVX512\w*|AMX_\w+|AVXVNNI|F16C|FMA|BMI2)__ 1")


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def niced(cmd: list[str]) -> list[str]:
    # the machine is shared (and benchmarks may run on it): builds run at the lowest priority
    return ["nice", "-n", "19", *cmd] if os.nice(0) < 19 else cmd


def sdist(version: str, src: Path) -> tuple[Path, Path]:
    """The downloaded sdist and its unpacked tree (both under `src`), fetched once."""
    src.mkdir(parents=True, exist_ok=True)
    archive = src / f"llama_cpp_python-{version}.tar.gz"
    if not archive.is_file():
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(src),
            f"llama-cpp-python=={version}"])
    tree = src / f"llama_cpp_python-{version}"
    if not (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    return archive, tree


def vendored_commit(tree: Path) -> str:
    """The llama.cpp commit the sdist's CHANGELOG names for this version (its first entry)."""
    m = re.search(r"llama\.cpp to ggml-org/llama\.cpp@([0-9a-f]{7,40})", (tree / "CHANGELOG.md").read_text())
    return m.group(1) if m else "unknown"


def compiler(path: str) -> str:
    return subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def native_isa(cc: str, extra: list[str]) -> list[str]:
    """The ISA macros `cc -march=native` (with the `extra` flags) defines (AVX2, AVX512*, AMX_*, ...)."""
    out = subprocess.run([cc, *extra, "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                         text=True).stdout
    return sorted(m.group(1) for m in ISA.finditer(out))


def cpu() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())


def build(version: str, cache: Path, jobs: int, no_amx: bool = False, tier: str = "native") -> Path:
    """The tools built under cache/version/build (build-noamx: `no_amx`; build-<tier> for a tier
    but native); the path of their build-info.json."""
    dest = cache / version
    build_dir = dest / ("build-noamx" if no_amx else "build" if tier == "native" else f"build-{tier}")
    bindir = build_dir / "bin"
    info_path = bindir / "build-info.json"
    if info_path.is_file() and all((bindir / t).is_file() for t in TOOLS):
        print(f"already built: {bindir}", file=sys.stderr)
        return info_path
    archive, tree = sdist(version, dest / "src")
    commit = vendored_commit(tree)
    flags = [*FLAGS, f"-DLLAMA_BUILD_COMMIT={commit}", *(NO_AMX if no_amx else []), *TIERS[tier]]
    if tier != "native":
        flags.remove("-DGGML_NATIVE=ON")
    sh(niced(["cmake", "-S", str(tree / "vendor" / "llama.cpp"), "-B", str(build_dir), *flags]))
    sh(niced(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
              "--target", *TOOLS]))
    resolved = {}
    for line in (build_dir / "CMakeCache.txt").read_text().splitlines():
        if m := RESOLVED.match(line):
            resolved[m.group(1)] = m.group(2)
    bench = subprocess.run([str(bindir / "llama-bench"), "--version"], capture_output=True, text=True)
    info = {
        "llama_cpp_python": version,
        "sdist": archive.name,
        "sdist_sha256": hashlib.sha256(archive.read_bytes()).hexdigest(),
        "llama_cpp_commit": commit,
        "cmake_flags": flags,
        "cmake_resolved": resolved,
        # (with GGML_NATIVE on, ggml-cpu builds with -march=native and its GGML_AVX* / GGML_AMX*
        # options, off, do not apply: the ISA below is what it gets)
        "compiler": compiler(resolved.get("CMAKE_C_COMPILER", "cc")),
        "native_isa": None if tier != "native" else native_isa(resolved.get("CMAKE_C_COMPILER", "cc"), NO_AMX_FLAGS.split() if no_amx else []),
        "cxx_compiler": compiler(resolved.get("CMAKE_CXX_COMPILER", "c++")),
        "llama_bench_version": (bench.stdout + bench.stderr).strip(),
        "cpu": cpu(),
        "bin": str(bindir),
        "tools": {t: str(bindir / t) for t in TOOLS},
    }
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    return info_path


def bindir(version: str = DEFAULT_VERSION, cache: Path = DEFAULT_CACHE, tier: str = "native") -> Path:
    """Where the tools are: $TURBO_LLAMACPP_BIN (a build of one's own), else a tier's build
    (`tier` not native), else this script's --no-amx build where there is one (it is made only
    where the default one faults), else its default build."""
    if os.environ.get(BIN_ENV):
        return Path(os.environ[BIN_ENV])
    if tier != "native":
        return cache / version / f"build-{tier}" / "bin"
    no_amx = cache / version / "build-noamx" / "bin"
    return no_amx if (no_amx / "build-info.json").is_file() else cache / version / "build" / "bin"


def tool(name: str, version: str = DEFAULT_VERSION, cache: Path = DEFAULT_CACHE, tier: str = "native") -> Path:
    """The path of a built tool (llama-bench, llama-server, llama-cli); a one-line error naming
    the build command where it is not built."""
    path = bindir(version, cache, tier) / name
    if not path.is_file():
        raise SystemExit(f"{path}: not built (nice -n 19 python -m scripts.build_llamacpp --tier {tier}, "
                         f"or set {BIN_ENV})")
    return path


def build_info(version: str = DEFAULT_VERSION, cache: Path = DEFAULT_CACHE, tier: str = "native") -> dict:
    """The build's build-info.json ({} for a build of one's own without it)."""
    path = bindir(version, cache, tier) / "build-info.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def binding(version: str, cache: Path, jobs: int) -> None:
    """The Python binding from the same sdist with its own default CMake flags, unless this
    version is installed already."""
    try:
        import llama_cpp

        if llama_cpp.__version__ == version:
            print(f"llama_cpp {version} installed: {llama_cpp.__file__}", file=sys.stderr)
            return
    except ImportError:
        pass
    archive, _ = sdist(version, cache / version / "src")
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
    sh(niced([sys.executable, "-m", "pip", "install", "--verbose", str(archive)]), env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python's version (its sdist's llama.cpp)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--binding", action="store_true", help="also pip install the binding from the same sdist")
    ap.add_argument("--no-amx", action="store_true",
                    help="without ggml's AMX kernels (where they fault), into build-noamx/ (NO_AMX above)")
    ap.add_argument("--tier", choices=sorted(TIERS), default="native",
                    help="the x86 ISA tier to build for (TIERS above), into build-<tier>/ (native: build/)")
    args = ap.parse_args()
    info = build(args.version, args.cache, args.jobs, args.no_amx, args.tier)
    print(info.read_text())
    if args.binding:
        binding(args.version, args.cache, args.jobs)


if __name__ == "__main__":
    main()

"""Rebuild kernels_ptx/*.ptx from kernels_ptx/*.cu (docs/DESIGN.md 7): one PTX per source per arch,
`name.sm_80.ptx` and `name.sm_90.ptx`, checked in and loaded at run time by
turbo/backends/cuda_kernels.py (no compiler at run time).

    python -m scripts.build_ptx            # rebuild every PTX (refuses an nvcc other than the pinned one)
    python -m scripts.build_ptx --check    # exit 1 naming each PTX that differs from what its .cu builds to
    python -m scripts.build_ptx --ptxas    # assemble every PTX for its arch with ptxas (exit 1 on failure)

The compiler is nvcc from the pip package `nvidia-cuda-nvcc` (PIP_PACKAGES pins it and the
NVVM / headers it runs with), found inside the installed package; `nvcc` on PATH is the
fallback. The output is a pure function of the source, the flags and the nvcc version
(no line info, no paths, no timestamps), so --check can compare bytes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels_ptx"
ARCHS = ("sm_80", "sm_90")
NVCC_VERSION = "13.0.88"  # the release whose output is checked in ("Cuda compilation tools, ... V13.0.88")
PIP_PACKAGES = (f"nvidia-cuda-nvcc=={NVCC_VERSION}", f"nvidia-nvvm=={NVCC_VERSION}",
                f"nvidia-cuda-crt=={NVCC_VERSION}", f"nvidia-cuda-runtime=={NVCC_VERSION}")
FLAGS = ("-ptx", "-O3", "--std=c++17")


def _package_tool(name: str) -> Path | None:
    """`name` from the bin/ of an installed nvidia-* pip package (nvidia/cu13/bin/nvcc ...)."""
    try:
        import nvidia  # namespace package shared by the nvidia-* wheels
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        for cand in sorted(Path(base).glob(f"*/bin/{name}")):
            if cand.is_file() and os.access(cand, os.X_OK):
                return cand
    return None


def find_tool(name: str) -> Path | None:
    """The pip package's tool, else the one on PATH, else None."""
    found = _package_tool(name)
    if found is None:
        on_path = shutil.which(name)
        found = Path(on_path) if on_path else None
    return found


def tool_version(tool: Path) -> str | None:
    """'13.0.88' from `tool --version` (nvcc and ptxas print 'V13.0.88')."""
    try:
        text = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\bV(\d+\.\d+\.\d+)", text)
    return m.group(1) if m else None


def pinned_nvcc() -> Path | None:
    """An nvcc of exactly NVCC_VERSION (the package's first, then PATH's), or None."""
    for cand in (_package_tool("nvcc"), shutil.which("nvcc")):
        if cand and tool_version(Path(cand)) == NVCC_VERSION:
            return Path(cand)
    return None


def host_compiler() -> str | None:
    """nvcc preprocesses every .cu with the host compiler (gcc) even for -ptx."""
    return shutil.which("gcc") or shutil.which("g++")


def sources() -> list[Path]:
    return sorted(KERNELS.glob("*.cu"))


def ptx_path(src: Path, arch: str) -> Path:
    return src.with_name(f"{src.stem}.{arch}.ptx")


def build_one(nvcc: Path, src: Path, arch: str) -> str:
    """The PTX text `src` builds to for `arch`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.ptx"
        env = dict(os.environ, LC_ALL="C")
        # run from the source's directory with a relative name: nothing machine-specific reaches the PTX
        cmd = [str(nvcc), *FLAGS, f"-arch={arch}", "-o", str(out), src.name]
        res = subprocess.run(cmd, cwd=src.parent, capture_output=True, text=True, env=env, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr.strip()}")
        return out.read_text()


def check(nvcc: Path) -> list[str]:
    """The checked-in PTX files that differ from (or lack) what their .cu builds to."""
    stale = []
    for src in sources():
        for arch in ARCHS:
            dst = ptx_path(src, arch)
            if not dst.exists() or dst.read_text() != build_one(nvcc, src, arch):
                stale.append(str(dst.relative_to(ROOT)))
    return stale


def assemble(ptxas: Path, ptx: Path, arch: str) -> str | None:
    """None when ptxas assembles `ptx` for `arch`, else its error text."""
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([str(ptxas), f"-arch={arch}", "-o", str(Path(tmp) / "out.cubin"), str(ptx)],
                             capture_output=True, text=True, timeout=600)
    return None if res.returncode == 0 else (res.stderr.strip() or f"exit {res.returncode}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare the checked-in PTX with a fresh build")
    ap.add_argument("--ptxas", action="store_true", help="assemble every PTX with ptxas for its arch")
    args = ap.parse_args(argv)
    if args.ptxas:
        ptxas = find_tool("ptxas")
        if ptxas is None:
            print("ptxas not found (pip install nvidia-cuda-nvcc, or put ptxas on PATH)", file=sys.stderr)
            return 1
        bad = 0
        for src in sources():
            for arch in ARCHS:
                err = assemble(ptxas, ptx_path(src, arch), arch)
                print(f"{ptx_path(src, arch).relative_to(ROOT)}: {'ok' if err is None else err}")
                bad += err is not None
        return 1 if bad else 0
    nvcc = pinned_nvcc()
    if nvcc is None:
        found = find_tool("nvcc")
        have = f"found {found} (V{tool_version(found)})" if found else "found none"
        print(f"nvcc V{NVCC_VERSION} is required ({have}); pip install {' '.join(PIP_PACKAGES)}", file=sys.stderr)
        return 1
    if host_compiler() is None:
        print("nvcc needs a host C compiler (gcc) on PATH, even for -ptx", file=sys.stderr)
        return 1
    if args.check:
        stale = check(nvcc)
        for path in stale:
            print(f"{path}: differs from what its .cu builds to with nvcc V{NVCC_VERSION}")
        return 1 if stale else 0
    for src in sources():
        for arch in ARCHS:
            dst = ptx_path(src, arch)
            dst.write_text(build_one(nvcc, src, arch))
            print(f"{dst.relative_to(ROOT)}  ({nvcc}, V{NVCC_VERSION}, {arch})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

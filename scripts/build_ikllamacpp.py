"""Build ik_llama.cpp's tools (llama-bench, llama-server), the llama.cpp fork its users pick for CPU
speed on Qwen3.5, from a checkout of its public repository, for one x86 ISA tier, so that
scripts/bench_tiers.py (--ik) can time it beside turbo and llama.cpp built for the same tier.

    git clone https://github.com/ikawrakow/ik_llama.cpp          # (or any clone / bare mirror of it)
    nice -n 19 python -m scripts.build_ikllamacpp --src ik_llama.cpp --tier avx2 [--jobs 2]

The checkout's HEAD is exported (git archive) to ~/.cache/turbo/ik_llama/<commit>/src and built in
build-<tier>/ beside it, CMake Release, its defaults otherwise (its IQK matrix products and
flash attention on); the tiers are scripts/build_llamacpp.py's (native: -march=native; avx2 and
avx512: GGML_NATIVE off and the tier's GGML_* options). bin/build-info.json records the commit, the
flags, the compiler and the CPU. Idempotent: a built tier is reported, not rebuilt.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

from scripts.build_llamacpp import TIERS, compiler, cpu, niced, sh

DEFAULT_CACHE = Path.home() / ".cache" / "turbo" / "ik_llama"
TOOLS = ("llama-bench", "llama-server")
FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON",
         "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF"]


def git(src: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(src), *args], check=True, capture_output=True).stdout


def export(src: Path, cache: Path) -> tuple[str, Path, list[str]]:
    """The checkout's HEAD commit, its tree exported under cache/<commit>/src (once), and the files
    whose contents the checkout lacks (a shallow mirror may leave out its largest blobs, the web
    UI's bundles: written empty, none of them is compiled into the tools timed)."""
    commit = git(src, "rev-parse", "HEAD").decode().strip()
    tree = cache / commit[:12] / "src"
    missing_list = tree.parent / "missing.json"
    if not (tree / "CMakeLists.txt").is_file():
        tree.mkdir(parents=True, exist_ok=True)
        try:
            with tarfile.open(fileobj=io.BytesIO(git(src, "archive", "--format=tar", "HEAD"))) as tar:
                tar.extractall(tree, filter="data")
            missing = []
        except subprocess.CalledProcessError:
            missing = export_blobs(src, tree)
        missing_list.write_text(json.dumps(missing) + "\n")
    return commit, tree, json.loads(missing_list.read_text())


def export_blobs(src: Path, tree: Path) -> list[str]:
    """HEAD's files one blob at a time (git archive stops at the first absent one); returns the
    paths whose blobs are absent, written empty."""
    missing = []
    for line in git(src, "ls-tree", "-r", "-z", "HEAD").split(b"\0"):
        if not line:
            continue
        meta, path = line.decode().split("\t", 1)
        mode, kind, sha = meta.split()
        if kind != "blob":
            continue  # (a submodule: ik_llama.cpp's build needs none)
        out = tree / path
        out.parent.mkdir(parents=True, exist_ok=True)
        blob = subprocess.run(["git", "-C", str(src), "cat-file", "blob", sha], capture_output=True)
        if blob.returncode != 0:
            missing.append(path)
        if mode == "120000" and blob.returncode == 0:
            out.symlink_to(blob.stdout.decode())
            continue
        out.write_bytes(blob.stdout if blob.returncode == 0 else b"")
        if mode == "100755":
            out.chmod(0o755)
    return missing


def build(src: Path, tier: str, jobs: int, cache: Path = DEFAULT_CACHE) -> Path:
    """The tools of `src`'s HEAD built for `tier`; the path of their build-info.json."""
    commit, tree, missing = export(src, cache)
    build_dir = tree.parent / f"build-{tier}"
    bindir = build_dir / "bin"
    info_path = bindir / "build-info.json"
    if info_path.is_file():
        print(f"already built: {bindir}", file=sys.stderr)
        return info_path
    flags = [*FLAGS, *TIERS[tier]]
    if tier != "native":
        flags.remove("-DGGML_NATIVE=ON")
    sh(niced(["cmake", "-S", str(tree), "-B", str(build_dir), *flags]))
    sh(niced(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *TOOLS]))
    info = {"ik_llama_commit": commit, "tier": tier, "cmake_flags": flags, "compiler": compiler("cc"),
            "cpu": cpu(), "absent_in_checkout": missing, "bin": str(bindir), "tools": {t: str(bindir / t) for t in TOOLS}}
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    return info_path


def bindir(tier: str, cache: Path = DEFAULT_CACHE) -> Path | None:
    """The newest build of `tier` under `cache` (None: none built)."""
    infos = sorted(cache.glob(f"*/build-{tier}/bin/build-info.json"), key=lambda p: p.stat().st_mtime)
    return infos[-1].parent if infos else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, required=True, help="a clone (or bare mirror) of ik_llama.cpp")
    ap.add_argument("--tier", choices=list(TIERS), default="native")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args()
    if not (args.src / "HEAD").is_file() and not (args.src / ".git").exists():
        sys.exit(f"error: --src {args.src}: not a git checkout of ik_llama.cpp")
    print(build(args.src, args.tier, args.jobs, args.cache))


if __name__ == "__main__":
    main()

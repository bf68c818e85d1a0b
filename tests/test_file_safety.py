"""Files handled safely (issue #33, class 4): repack reads nothing through a link out of SRC and keeps
permission bits, error lines print no bytes of a file, stale temporaries are removed only when they are
repack's own, the native library's cache is private, and `./tiny` does not replace the shipped install."""

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from turbo.backends import native_build
from turbo.errors import TurboError
from turbo.repack import repack
from turbo.repack.write import MARKER
from turbo.store.install import BUNDLED_DIR, resolve
from turbo.testing import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("ck") / "hf"
    make_checkpoint(src, 0)
    return src


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    src = tmp_path / "hf"
    shutil.copytree(checkpoint, src)
    return src


@pytest.mark.parametrize("name", ["tokenizer_config.json", "merges.txt", "config.json", "model.safetensors"])
def test_a_link_out_of_src_is_refused_naming_it(tmp_path, checkpoint, name):
    secret = tmp_path / "secret"
    secret.write_text("SECRETX:$6$hash:19000:0:99999:7:::\n")
    secret.chmod(0o640)
    src = copy_of(checkpoint, tmp_path)
    (src / name).unlink(missing_ok=True)
    (src / name).symlink_to(secret)
    with pytest.raises(TurboError) as e:
        repack(src, tmp_path / "inst", quiet=True)
    assert str(e.value) == f"{src / name}: a symbolic link out of {src} (repack reads only the checkpoint's own files)"
    assert not (tmp_path / "inst").exists() and "SECRETX" not in str(e.value)


def test_links_inside_src_and_into_the_hf_cache_blobs_are_followed(tmp_path, checkpoint):
    snapshot = tmp_path / "models--o--n" / "snapshots" / "abc"
    blobs = tmp_path / "models--o--n" / "blobs"
    shutil.copytree(checkpoint, blobs)
    snapshot.mkdir(parents=True)
    for f in blobs.iterdir():
        (snapshot / f.name).symlink_to(Path("../../blobs") / f.name)
    (snapshot / "tokenizer_config.json").unlink()
    (snapshot / "tokenizer_config.json").symlink_to(snapshot / "config.json")  # inside SRC
    out = repack(snapshot, tmp_path / "inst", quiet=True)
    assert (out / "tokenizer_config.json").read_bytes() == (blobs / "config.json").read_bytes()


def test_copied_files_keep_their_bits_and_generated_ones_follow_the_umask(tmp_path, checkpoint):
    src = copy_of(checkpoint, tmp_path)
    (src / "tokenizer_config.json").chmod(0o600)
    (src / "tokenizer.json").chmod(0o640)
    (src / "merges.txt").write_text("")
    (src / "merges.txt").chmod(0o666)
    (src / "model.safetensors").chmod(0o600)
    old = os.umask(0o022)
    try:
        out = repack(src, tmp_path / "inst", quiet=True)
        text_only = repack(src, tmp_path / "inst2", quiet=True, text_only=True)
    finally:
        os.umask(old)
    assert mode(out / "tokenizer_config.json") == 0o600 and mode(out / "tokenizer.json") == 0o640
    assert mode(out / "merges.txt") == 0o644  # the source's 0666, no more than the umask allows
    assert mode(out / "model.safetensors") == 0o644 and mode(text_only / "config.json") == 0o644
    assert not (out / MARKER).exists()


def test_a_text_file_as_model_safetensors_prints_none_of_its_bytes(tmp_path, checkpoint):
    src = copy_of(checkpoint, tmp_path)
    (src / "model.safetensors").write_text("SECRETX:secret-hash-and-more-text\n" * 3)
    with pytest.raises(TurboError) as e:
        repack(src, tmp_path / "inst", quiet=True)
    n = int.from_bytes(b"SECRETX:", "little")
    assert str(n) not in str(e.value) and "SECRETX" not in str(e.value) and "not a safetensors file" in str(e.value)


def test_stale_temporaries_are_removed_only_when_repack_marked_them(tmp_path, checkpoint, capfd):
    dead = 2 ** 22 + 12345  # above the default pid_max: no such process
    ours = tmp_path / f".old.repack-{dead}-0123abcd"
    ours.mkdir()
    (ours / MARKER).touch()
    foreign = tmp_path / f".other.repack-{dead}-0123abce"
    foreign.mkdir()
    (foreign / "keep").write_text("x")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / MARKER).touch()
    link = tmp_path / f".link.repack-{dead}-0123abcf"
    link.symlink_to(target)
    repack(checkpoint, tmp_path / "inst", quiet=True)
    err = capfd.readouterr().err
    assert not ours.exists() and f"removed {ours}" in err
    assert (foreign / "keep").exists() and link.is_symlink() and (target / MARKER).exists()


# ---- the native library's cache ------------------------------------------------------------------

FAKE_CC = """#!/bin/sh
case "$1" in --version) echo turbo-test-cc 1; exit 0;; esac
while [ "$#" -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done
echo built > "$out"
"""


@pytest.fixture
def cc(tmp_path, monkeypatch) -> str:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmpdir"))
    (tmp_path / "tmpdir").mkdir()
    monkeypatch.setattr(native_build, "_announce", lambda line: None)
    path = tmp_path / "cc"
    path.write_text(FAKE_CC)
    path.chmod(0o755)
    return str(path)


def plant(directory: Path, cc: str, dir_mode: int, file_mode: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    planted = directory / f"native-{native_build._key(cc)}.so"
    planted.write_text("planted")
    planted.chmod(file_mode)
    directory.chmod(dir_mode)
    return planted


def test_the_cache_is_created_private(tmp_path, cc):
    path, throwaway = native_build.build(cc, tmp_path / "cache" / "turbo")
    assert path.parent == tmp_path / "cache" / "turbo" and throwaway is None
    assert mode(path.parent) == 0o700 and mode(path) == 0o755 and path.read_text() == "built\n"


def test_a_library_in_a_world_writable_directory_is_never_loaded(tmp_path, cc):
    planted = plant(tmp_path / "shared", cc, 0o777, 0o755)
    path, _ = native_build.build(cc, tmp_path / "shared")
    assert path.read_text() == "built\n" and path.parent == tmp_path / "tmpdir" / "turbo-native"
    assert planted.read_text() == "planted"


def test_a_writable_library_in_the_private_cache_is_rebuilt(tmp_path, cc):
    planted = plant(tmp_path / "cache", cc, 0o700, 0o666)
    path, _ = native_build.build(cc, tmp_path / "cache")
    assert path == planted and path.read_text() == "built\n" and mode(path) == 0o755


def test_a_planted_tmpdir_fallback_gives_a_fresh_private_directory(tmp_path, cc):
    (tmp_path / "file").write_text("x")  # the cache cannot be created under a file
    planted = plant(tmp_path / "tmpdir" / "turbo-native", cc, 0o777, 0o755)
    path, throwaway = native_build.build(cc, tmp_path / "file" / "cache")
    assert throwaway == path.parent and path.parent.parent == tmp_path / "tmpdir"
    assert path.parent.name.startswith("turbo-native-") and mode(path.parent) == 0o700
    assert path.read_text() == "built\n" and planted.read_text() == "planted"
    assert "writable by others" in native_build.untrusted(planted.parent)


# ---- the shipped install by name, a path as a path -------------------------------------------------

def cli(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "turbo", f"hydra.run.dir={cwd}/hydra", "threads=1", "backend=cpu", "prompt=def f",
           "max_new_tokens=6", "+policy=off", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=120)


def test_a_tiny_directory_in_the_working_directory_is_not_the_shipped_install(tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text('{"model_type": "planted"}')  # refused, were it opened
    planted = cli(tmp_path)
    assert planted.returncode == 0 and planted.stderr.startswith("[stats]"), planted.stderr
    assert planted.stderr.count("\n") == 1 and planted.stdout and "[stats]" not in planted.stdout
    as_path = cli(tmp_path, "install.path=tiny")
    assert as_path.returncode == 2 and as_path.stderr.count("\n") == 1 and "tiny/config.json" in as_path.stderr
    monkeypatch.chdir(tmp_path)
    assert resolve("tiny") == BUNDLED_DIR / "tiny" and resolve("./tiny") == Path("tiny")
    assert resolve(Path("tiny")) == Path("tiny")

"""The first run's build of the native library, as a user meets it: one stderr line saying what
it compiles, about how long and where it is cached (none once cached), and nothing left in the
cache when the build is interrupted.

The compiler is a stand-in (CC): it copies the library this process loaded instead of compiling,
so a cold cache costs no real build, and it can wait first, so a signal lands while it runs."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import turbo
from turbo.backends import native_build, native_lib
from turbo.sequence.options import OpenOptions

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = """#!/bin/sh
case "$1" in --version) echo turbo-test-cc 1; exit 0;; esac
while [ "$#" -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done
touch "$MARK"
sleep "${SLEEP:-0}"
cp "$PREBUILT" "$out"
"""
ANNOUNCED = "compiling turbo's CPU kernels (native*.c) with "


@pytest.fixture
def compiler(tmp_path) -> Path:
    lib = native_lib.library(OpenOptions.from_env().cache_dir)
    if lib is None:
        pytest.skip(f"no native library here: {native_lib.why_not()}")
    cc = tmp_path / "cc"
    cc.write_text(STAND_IN)
    cc.chmod(0o755)
    return cc


def start(tmp_path: Path, cc: Path, sleep: int = 0) -> subprocess.Popen:
    env = dict(os.environ, TURBO_CACHE=str(tmp_path / "cache"), CC=str(cc), MARK=str(tmp_path / "compiling"),
               SLEEP=str(sleep), PREBUILT=native_lib.library()._name, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "turbo", "max_new_tokens=2", "threads=1", "backend=cpu", "prompt=hi"]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_first_build_says_so_once(tmp_path, compiler):
    cache = tmp_path / "cache" / "turbo"
    out, err = start(tmp_path, compiler).communicate(timeout=300)
    lines = err.splitlines()  # the announcement, then the stats line (stdout: the text alone)
    assert lines[:1] == [f"{ANNOUNCED}{compiler}: {native_build.BUILD_TIME}, once per machine; cached in {cache}"], err
    assert len(lines) == 2 and lines[1].startswith("[stats]") and "[stats]" not in out
    assert [p.name.startswith("native-") for p in cache.iterdir()] == [True]
    (tmp_path / "compiling").unlink()
    again = start(tmp_path, compiler)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0 and err.startswith("[stats]") and err.count("\n") == 1, err  # cached: nothing said
    assert not (tmp_path / "compiling").exists()  # nor compiled


@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "")])
def test_an_interrupted_build_leaves_nothing(tmp_path, compiler, sig, code, said):
    proc = start(tmp_path, compiler, sleep=60)
    deadline = time.monotonic() + 240
    while not (tmp_path / "compiling").exists():  # the compiler runs
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(sig)  # to turbo alone: a terminal's Ctrl-C reaches the compiler too
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert err.splitlines()[1:] == ([said] if said else []), err
    assert list((tmp_path / "cache" / "turbo").iterdir()) == []


def test_the_tui_shows_the_build_while_loading(monkeypatch):
    pytest.importorskip("textual")
    from tui.app import TurboApp
    from tui.settings import Settings

    opened = turbo.open

    def building(*args, **kw):  # this process's library is built: the line a first build says
        native_build._announce("compiling turbo's CPU kernels ...")
        return opened(*args, **kw)

    seen, show = [], TurboApp._set_status

    def shown(self, message: str, error: bool = False) -> None:
        seen.append(message)
        show(self, message, error)

    monkeypatch.setattr(turbo, "open", building)
    monkeypatch.setattr(TurboApp, "_set_status", shown)
    app = TurboApp(Settings(opening=OpenOptions.from_env(backend="cpu")))

    async def run():
        async with app.run_test() as pilot:
            while app.runtime is None and app.load_error is None:
                await asyncio.sleep(0.05)
            await pilot.pause()

    asyncio.run(run())
    assert "loading tiny: compiling turbo's CPU kernels ..." in seen, seen
    assert native_build._announce is native_build._to_stderr  # the TUI's hook was for its load alone

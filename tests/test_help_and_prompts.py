"""`python -m turbo --help` (turbo's own page: conf/hydra/help/turbo.yaml) and the ways to give a
prompt that Hydra's grammar cannot carry: prompt_file=PATH, prompt=- (standard input), and the
TUI's multi-line prompt box (ctrl+j or shift+enter inserts a newline, enter submits)."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys

import pytest
import yaml
from textual import events

import turbo
from turbo import shipped
from turbo.__main__ import composed
from turbo.config import run_config
from turbo.errors import TurboError
from turbo.testing.checks import run_clis
from tui import TurboApp
from test_tui import SIZE, settings, settle, type_prompt
from test_tui_chat import THINKING_CHATML, chat_settings, check_turn

# a prompt Hydra's grammar refuses as prompt=: a newline, parentheses, a colon, a comma
CODE = "def f(x):\n    return (x, 1)\n"
ONE_LINE = "def f(x): return (x, 1)"


def turbo_cli(tmp_path, *args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "turbo", "threads=1", "backend=cpu", *args]
    return subprocess.run(cmd, capture_output=True, input=stdin if stdin is not None else b"", cwd=tmp_path,
                          timeout=120)


def turbo_clis(tmp_path, *calls: tuple) -> list[subprocess.CompletedProcess]:
    return run_clis(tmp_path, list(calls), ("threads=1", "backend=cpu"))


def one_line_error(proc, *needles) -> None:
    err = proc.stderr.decode()
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


# ---- --help ------------------------------------------------------------------------------------


def test_help_is_turbos_page_with_every_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "turbo", "--help"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    page = proc.stdout
    lines = page.splitlines()
    assert len(lines) < 60 and "README.md" in page and page.count("python -m turbo ") >= 3
    keys = [k for k in yaml.safe_load((shipped.CONF_DIR / "config.yaml").read_text()) if k != "defaults"]
    assert len(keys) > 20
    for key in keys:
        assert any(line.startswith(f"{key}:") for line in lines), f"--help misses the key {key!r}"
    groups = lines[lines.index("== Groups (GROUP=OPTION) ==") + 1:]
    for group in ("install", "workload", "task", "policy", "hydra/launcher"):
        options = sorted(p.stem for p in (shipped.CONF_DIR / group).glob("*.yaml"))
        line = next((x for x in groups if x.lstrip("+").startswith(f"{group}=")), None)
        assert line is not None and all(o in line for o in options), (group, options, line)
    assert "class Codec" not in page and "Problem:" not in page  # the workloads' prompts stay off the page


def test_hydra_help_stays_hydras(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "turbo", "--hydra-help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "Hydra (" in proc.stdout and "--hydra-help" in proc.stdout


# ---- prompt_file= and prompt=- -----------------------------------------------------------------


def stream_of(proc) -> tuple[str, str]:
    """(the streamed text: the continuation alone, as stdout holds it; the stats line: stderr's
    last) of a successful run."""
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode(), proc.stderr.decode().strip().splitlines()[-1]


def test_prompt_file_and_stdin_equal_the_api_and_prompt(spec_install, tmp_path):
    path = spec_install[1]
    (tmp_path / "code.txt").write_text(CODE)
    (tmp_path / "one.txt").write_text(ONE_LINE)
    common = (f"install.path={path}", "max_new_tokens=12")
    cfg, problem = composed(list(common) + [f"prompt_file={tmp_path}/code.txt"])
    assert problem is None
    rc = run_config(cfg)
    assert rc.prompt == CODE
    rt = turbo.open(str(path), backend="cpu")
    want = rt.generate(CODE, rc.generation)

    # where prompt= can say it (one line, the override quoted whole), all three stream the same
    runs = [stream_of(p) for p in turbo_clis(
        tmp_path, (*common, "prompt_file=code.txt"), (*common, "prompt=-", CODE.encode()),
        (*common, f"prompt='{ONE_LINE}'"), (*common, "prompt_file=one.txt"), (*common, "prompt=-", ONE_LINE.encode()))]
    for text, stats in runs[:2]:
        assert text == want.text
        assert f"prompt {want.stats.prompt_tokens} tok | generated {len(want.tokens)} tok" in stats
    one = rt.generate(ONE_LINE, rc.generation)
    for text, _ in runs[2:]:
        assert text == one.text


def test_run_config_reads_stdin_only_for_a_dash():
    cfg, _ = composed(["prompt=-"])
    assert run_config(cfg, stdin=io.BytesIO(CODE.encode())).prompt == CODE
    cfg, _ = composed(["prompt=hello"])
    assert run_config(cfg, stdin=io.BytesIO(b"unread")).prompt == "hello"
    cfg, _ = composed([])
    assert run_config(cfg).prompt.startswith("class StreamWriter")  # the workload's first prompt
    cfg, _ = composed(["prompt=-", "task=chat"])
    with pytest.raises(TurboError, match="task=chat reads the conversation"):
        run_config(cfg, stdin=io.BytesIO(b"x"))


def test_prompt_refusals_are_one_line(tmp_path):
    (tmp_path / "p.txt").write_text("hi")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    procs = turbo_clis(tmp_path, ("prompt=hi", "prompt_file=p.txt"), ("prompt_file=nowhere.txt",),
                       (f"prompt_file={tmp_path}",), ("prompt_file=latin1.txt",), ("prompt=-", b"\xff\xfe"),
                       ("prompt=-", "task=chat", b"hi\n"), ("prompt=echo ${HOME}",))
    for proc, needles in zip(procs, [("prompt= and prompt_file=", "give one"), ("prompt_file=nowhere.txt", "No such file"),
                                     ("Is a directory",), ("latin1.txt", "not UTF-8", "byte 3"),
                                     ("standard input", "not UTF-8"), ("task=chat",),
                                     ("HOME", "prompt_file=")]):  # (the last: an interpolation)
        one_line_error(proc, *needles)


# ---- the TUI's multi-line prompt ---------------------------------------------------------------


def test_tui_ctrl_j_inserts_a_newline_and_enter_submits(spec_install):
    rt = turbo.open(str(spec_install[1]), backend="cpu")
    s = settings(spec_install[1])

    async def run():
        app = TurboApp(s, runtime=rt, timing=False)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            await type_prompt(pilot, "def f(x):")
            await pilot.press("ctrl+j", "space", "space", "space", "shift+enter")  # shift+enter: where reported
            box = app.query_one("#prompt")
            assert box.value == "def f(x):⏎   ⏎" and not app.busy and app.transcript is None
            await pilot.press("backspace", "space", *"return", "space", *"(x,", "space", *"1)", "ctrl+j")
            await pilot.press("enter")
            await settle(app, pilot)
            assert app.last_outcome == "done", app.last_error
            want = rt.generate(CODE, s.generation)
            assert app.prompt_shown == CODE
            assert app.output_text == want.text and app.transcript.tokens == want.tokens

    asyncio.run(run())


def test_tui_chat_message_box_takes_a_newline(tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(THINKING_CHATML)

    async def run():
        app = TurboApp(chat_settings(str(template)), runtime=turbo.open("tiny", backend="cpu"), timing=False)
        async with app.run_test(size=(130, 40)) as pilot:
            await settle(app, pilot)
            assert app.chat_on
            await type_prompt(pilot, "one")
            await pilot.press("ctrl+j", *"two")
            app.query_one("#prompt").post_message(events.Paste("\nthree"))  # a paste keeps its newlines
            await pilot.pause()
            await pilot.press("enter")
            await settle(app, pilot)
            check_turn(app)
            assert app.session.history[-2] == {"role": "user", "content": "one\ntwo\nthree"}

    asyncio.run(run())

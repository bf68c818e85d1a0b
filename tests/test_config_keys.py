"""The config keys a user meets: verbose (the backend note), stop_at_eos and truncate_prompt
from the command line, and the README's key lists against conf/config.yaml and the TUI's bindings."""

import re
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import turbo
from turbo.errors import TurboError
from turbo.testing import make_install
from turbo.testing.checks import run_clis

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def clis(tmp_path, *calls: tuple) -> list[subprocess.CompletedProcess]:
    return run_clis(tmp_path, list(calls), ("threads=1", "max_new_tokens=4"), text=True)


def stats_line(proc) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.strip().splitlines()[-1]  # (stdout: the continuation alone)


def test_the_backend_note_only_under_verbose(tmp_path):
    quiet, said, refused = clis(tmp_path, ("prompt=hi",), ("prompt=hi", "verbose=true"),
                                ("prompt=hi", "verbose=maybe"))
    stats_line(quiet), stats_line(said)
    assert "backend auto picked" not in quiet.stderr
    assert "backend auto picked" in said.stderr  # cpu (and why cuda is not there) or cuda
    assert refused.returncode == 2 and refused.stderr.strip() == "error: verbose is 'maybe', expected true or false"


def test_stop_at_eos_false_goes_on_past_the_end_of_text(tmp_path):
    # tiny ends "Answer: 42" after two tokens
    stopped, past = map(stats_line, clis(tmp_path, ("prompt='Answer: 42'", "max_new_tokens=12", "backend=cpu"),
                                         ("prompt='Answer: 42'", "max_new_tokens=12", "backend=cpu", "stop_at_eos=false")))
    assert "generated 2 tok" in stopped and "generated 12 tok" in past


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """A random trunk of 64 positions."""
    _, path = make_install(tmp_path_factory.mktemp("short"), 3, max_position_embeddings=64)
    return path


def test_truncate_prompt_left_keeps_the_tail(short_context, tmp_path):
    rt = turbo.open(short_context, backend="cpu")
    ids = [(7 * i + 3) % rt.install.arch.vocab for i in range(80)]
    with pytest.raises(TurboError, match="max_position_embeddings 64 .truncate_prompt=left keeps its last 56."):
        rt.generate(ids, max_new_tokens=8, policy="off")
    cut = rt.generate(ids, max_new_tokens=8, policy="off", truncate_prompt="left", stop_at_eos=False)
    tail = rt.generate(ids[-56:], max_new_tokens=8, policy="off", stop_at_eos=False)
    assert cut.tokens == tail.tokens and len(cut.tokens) == 8
    assert (cut.stats.prompt_tokens, cut.stats.prompt_truncated_from) == (56, 80)
    assert tail.stats.prompt_truncated_from is None
    line = stats_line(clis(tmp_path, (f"install.path={short_context}", "backend=cpu", "+policy=off",
                                      "prompt='" + "one two three " * 30 + "'", "max_new_tokens=8",
                                      "truncate_prompt=left"))[0])
    assert re.search(r"\| prompt truncated: kept the last 56 of \d+ tokens \|", line), line


def readme_section(title: str) -> str:
    return README.split(f"\n### {title}\n")[1].split("\n#")[0]


def test_the_readme_lists_every_config_key():
    listed = re.search(r"\nConfig keys \(.*?\):(.*?)\.\n", readme_section("The command line"), re.S).group(1)
    keys = re.findall(r"`(\w+)`", listed)
    config = [k for k in OmegaConf.load(ROOT / "conf" / "config.yaml") if k != "defaults"]
    assert len(keys) == len(set(keys)) and set(keys) == set(config)


def test_the_readme_lists_every_tui_key():
    pytest.importorskip("textual")
    import tui.app  # (the tui extra)
    import tui.chat

    key = re.compile(r"(?:ctrl|shift|alt)\+\S+|enter|escape|tab")
    section = readme_section("The TUI")
    listed = {k for k in re.findall(r"`([^`]+)`", section) if key.fullmatch(k)}
    classes = [c for m in (tui.app, tui.chat) for c in vars(m).values()
               if isinstance(c, type) and c.__module__ == m.__name__ and "BINDINGS" in vars(c)]
    assert {tui.app.TurboApp, tui.app.PromptInput} <= set(classes)
    bound = {k.strip() for c in classes for b in c.BINDINGS for k in b.key.split(",")}
    assert listed == bound
    # and the commands typed in the box
    typed = set(re.findall(r'startswith\("(/\w+) "\)', Path(tui.app.__file__).read_text()
                           + Path(tui.app.__file__).with_name("images.py").read_text()))  # (chat: /image)
    assert set(re.findall(r"`(/\w+) PATH`", section)) == typed == {"/open", "/template", "/image"}


def test_the_readme_lists_every_serve_key_and_the_defaults_agree():
    from turbo.serve.scheduler import ServeLimits
    from turbo.serve.settings import ServeConfig

    section = readme_section("Serving")
    serve = OmegaConf.load(ROOT / "conf" / "task" / "serve.yaml").serve
    assert set(re.findall(r"`serve\.(\w+)`", section)) >= set(serve)
    limits, config = ServeLimits(), ServeConfig()
    for key, value in serve.items():
        assert value == getattr(limits, key) if hasattr(limits, key) else value == getattr(config, key), key

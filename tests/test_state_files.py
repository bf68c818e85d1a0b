"""Kept states on disk (turbo/sequence/state_files.py): an entry round-trips bit for bit and goes
on as a cold run does; a truncated, damaged, foreign or other-numerics file is refused by name and
never used; a server (worker.Engine with serve.state_dir) restarted serves from the states it
wrote; a saved chat session, loaded, answers as the original and as a cold chat."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import turbo
from turbo.errors import TurboError
from turbo.sequence import state_files
from turbo.sequence.options import GenerationOptions as G
from turbo.sequence.options import OpenOptions
from turbo.sequence.state_cache import Keeper
from turbo.sequence.state_files import (StateDir, StateFileError, dense_kv, install_fingerprint, kept_of, put,
    read_states, stamp_of, write_states)
from turbo.store.install import open_install
from turbo.testing.checks import served_address

DFLASH = dict(policy="fixed", block=4, drafter="dflash")


@pytest.fixture(scope="module")
def rt():
    return turbo.open("tiny", threads=1)


@pytest.fixture(scope="module")
def stamp(rt):
    return stamp_of(rt.install, rt.trunk, rt.options)


def prompt(rt, text: str = "def fib(n):\n    if n < 2:\n        return n\n") -> list[int]:
    return rt.encode(text)


def prefix_entry(rt, ids: list[int], opts: G):
    """A server's kept state at the prompt's end (a prefix cache's copy) and the answer."""
    keeper = Keeper.prefix_cache(2**30)
    answer = rt.generate(ids, opts, keeper=keeper).tokens
    return keeper.kept.entries[tuple(ids)], answer


def same(a, b) -> bool:
    """Two snapshot trees equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def test_an_entry_round_trips_and_goes_on_as_a_cold_run(rt, stamp, tmp_path):
    ids = prompt(rt)
    o = G(max_new_tokens=16, **DFLASH)
    e, _ = prefix_entry(rt, ids, o)
    path = tmp_path / "one.turbo-state"
    assert write_states(path, stamp, [kept_of(e)], dense_kv(e)) == []
    f = read_states(path, stamp, rt.trunk.device)
    (k,) = f.kept
    assert k.tokens == e.tokens and k.trunk.pos == e.trunk.pos and k.trunk.rope_delta == e.trunk.rope_delta
    assert same(k.trunk.gdn, e.trunk.gdn) and same(f.kv, dense_kv(e)) and same(k.drafts, e.drafts)
    assert not list(tmp_path.glob(".*.tmp"))  # (written whole: the temporary file renamed)
    # a cache filled from the file serves the prompt with the tokens a cold run gives
    longer = list(ids) + prompt(rt, "    return fib(n - 1)")
    for opts in (o, G(max_new_tokens=16, temperature=0.8, seed=3, **DFLASH)):
        keeper = Keeper.prefix_cache(2**30)
        put(keeper.kept, k, f.kv)
        events = list(rt.stream(longer, opts, keeper=keeper))
        assert events[0].cached_tokens == len(ids) - 1
        assert [t for ev in events for t in ev.tokens] == rt.generate(longer, opts).tokens


def test_a_drafter_context_that_is_not_plain_is_left_out_and_said(rt, stamp, tmp_path):
    e, _ = prefix_entry(rt, prompt(rt), G(max_new_tokens=4, **DFLASH))
    k = kept_of(e)
    k.drafts[("custom", None)] = (1.5, torch.zeros(2))
    path = tmp_path / "x.turbo-state"
    (note,) = write_states(path, stamp, [k], dense_kv(e))
    assert path.name in note and "drafter ('custom', None): its context is left out (a float" in note
    assert set(read_states(path, stamp, rt.trunk.device).kept[0].drafts) == set(e.drafts)


@pytest.fixture(scope="module")
def written(rt, stamp, tmp_path_factory):
    """A good state file's bytes."""
    e, _ = prefix_entry(rt, prompt(rt), G(max_new_tokens=4, **DFLASH))
    path = tmp_path_factory.mktemp("good") / "good.turbo-state"
    write_states(path, stamp, [kept_of(e)], dense_kv(e))
    return path.read_bytes(), e


@pytest.fixture(scope="module")
def other_install(tmp_path_factory):
    pytest.importorskip("transformers")
    from turbo.testing import make_install

    _, path = make_install(tmp_path_factory.mktemp("other"), seed=1)
    return open_install(path)


def refused(path, stamp, device, says: str) -> str:
    with pytest.raises(StateFileError) as err:
        read_states(path, stamp, device)
    line = str(err.value)
    assert line.startswith(f"{path}: ") and says in line and "\n" not in line, line
    return line


def test_a_truncated_damaged_foreign_or_other_numerics_file_is_refused_by_name(rt, stamp, written, other_install,
                                                                                tmp_path, monkeypatch):
    blob, e = written
    dev = rt.trunk.device
    cut = tmp_path / "cut.turbo-state"
    cut.write_bytes(blob[:-100])
    refused(cut, stamp, dev, "truncated")
    cut.write_bytes(blob[:5])
    refused(cut, stamp, dev, "truncated")
    flipped = tmp_path / "flipped.turbo-state"
    flipped.write_bytes(blob[:-7] + bytes([blob[-7] ^ 0x10]) + blob[-6:])
    refused(flipped, stamp, dev, "digest mismatch")
    n = int.from_bytes(blob[:8], "little")
    header = blob[8:8 + n]
    at = header.index(b'"turbo.state.entries"')
    at = next(i for i in range(at, len(header)) if header[i:i + 1].isdigit())  # (a token's digit: still JSON)
    digit = b"1" if header[at:at + 1] != b"1" else b"2"
    flipped.write_bytes(blob[:8 + at] + digit + blob[8 + at + 1:])
    refused(flipped, stamp, dev, "digest mismatch")
    # another install of the same shapes (other weights), other numerics, another version
    assert install_fingerprint(other_install) != stamp.install
    good = tmp_path / "good.turbo-state"
    good.write_bytes(blob)
    refused(good, dataclasses.replace(stamp, install=install_fingerprint(other_install)), dev,
            "written by another install")
    for field, value in (("kv_dtype", "float32" if stamp.numerics["kv_dtype"] != "float32" else "bfloat16"),
                         ("bf16_products", "exact" if stamp.numerics["bf16_products"] != "exact" else "auto")):
        other = dataclasses.replace(stamp, numerics={**stamp.numerics, field: value})
        refused(good, other, dev, f"written under other numerics: {field} {stamp.numerics[field]} (here {value})")
    monkeypatch.setattr(state_files, "FORMAT_VERSION", 2)
    future = tmp_path / "future.turbo-state"
    write_states(future, stamp, [kept_of(e)], dense_kv(e))
    monkeypatch.undo()
    refused(future, stamp, dev, "unknown version '2'")
    pipe = tmp_path / "pipe.turbo-state"
    os.mkfifo(pipe)
    refused(pipe, stamp, dev, "not a regular file")
    junk = tmp_path / "junk.turbo-state"
    junk.write_bytes(b"\x10" + b"\x00" * 7 + b"{not json}      ")
    refused(junk, stamp, dev, "not a state file")


def test_a_state_dir_loads_what_matches_and_drops_the_rest_saying_why(rt, stamp, written, tmp_path):
    blob, e = written
    (tmp_path / "good.turbo-state").write_bytes(blob)
    (tmp_path / "cut.turbo-state").write_bytes(blob[:-1])
    (tmp_path / "flipped.turbo-state").write_bytes(blob[:-3] + bytes([blob[-3] ^ 1]) + blob[-2:])
    (tmp_path / "notes.txt").write_text("not ours")
    lines: list[str] = []
    states = StateDir(tmp_path, 2**30, stamp, rt.trunk.device, lines.append)
    keeper = Keeper.prefix_cache(2**30)
    assert states.load_into(keeper.kept) == 1
    states.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.turbo-state", "notes.txt"]
    assert len(lines) == 2 and all(line.endswith("; removed") for line in lines)
    assert any("cut.turbo-state: truncated" in line for line in lines)
    assert any("flipped.turbo-state: digest mismatch" in line for line in lines)
    assert list(keeper.kept.entries) == [e.tokens]


def test_the_state_dir_keeps_to_its_bound_the_oldest_going_first(rt, stamp, tmp_path):
    lines: list[str] = []
    keeper = Keeper.prefix_cache(2**30)
    for text in ["def a():", "def b():", "def c():"]:
        rt.generate(prompt(rt, text), G(max_new_tokens=4, policy="off"), keeper=keeper)
    entries = list(keeper.kept.entries.values())

    def write_all(bound: int) -> dict[str, int]:
        states = StateDir(tmp_path, bound, stamp, rt.trunk.device, lines.append)
        for entry in entries:
            states.kept(entry)
        states.close()
        return {p.name: p.stat().st_size for p in tmp_path.glob("*.turbo-state")}

    sizes = write_all(2**30)
    assert len(sizes) == len(entries)
    for p in tmp_path.glob("*.turbo-state"):
        p.unlink()
    bound = int(2.5 * max(sizes.values()))
    kept = write_all(bound)
    names = [state_files.file_name(e.tokens) for e in entries]
    assert 0 < sum(kept.values()) <= bound and names[-1] in kept and names[0] not in kept and lines == []


pytest.importorskip("prometheus_client")


def engine(state_dir, cache_gb: float = 1.0):
    from turbo.serve.settings import ServeConfig, ServeLimits
    from turbo.serve.worker import Engine

    return Engine("tiny", OpenOptions.from_env(threads=1), G(),
                  ServeConfig(state_dir=str(state_dir), limits=ServeLimits(cache_gb=cache_gb)))


def serve(eng, ids: list[int], opts: G, marks: dict | None = None):
    from turbo.serve.scheduler import Request

    deltas: list = []
    eng.scheduler.submit(Request(list(ids), opts, marks=marks or {}), deltas.append)
    for _ in range(1000):
        if deltas and (isinstance(deltas[-1], Exception) or deltas[-1].finish):
            break
        eng.scheduler.step()
    assert not isinstance(deltas[-1], Exception), deltas[-1]
    return [t for d in deltas for t in d.tokens], deltas[0].cached_tokens


def test_a_restarted_server_serves_from_the_states_it_wrote(rt, tmp_path, capfd):
    ids = prompt(rt, "You are a helpful assistant.\nQ: What does os.path.join do?\nA:")
    o = G(max_new_tokens=12, **DFLASH)
    first = engine(tmp_path / "states")
    answer, cached = serve(first, ids, o)
    assert answer == rt.generate(ids, o).tokens and cached == 0
    kept = list(first.scheduler.cache.entries)  # (the prompt's end, and the answer's where a round ended there)
    first.stop()
    assert len(list((tmp_path / "states").glob("*.turbo-state"))) == len(kept) > 0
    again = engine(tmp_path / "states")
    assert sorted(again.scheduler.cache.entries) == sorted(kept)
    nxt = ids + answer + rt.encode("\nQ: and os.path.split?\nA:")
    loaded = max(len(k) for k in kept) - 1  # (the first request's prompt: then this one's is kept too)
    for opts, least in ((o, loaded), (G(max_new_tokens=12, temperature=0.7, seed=5, **DFLASH), len(nxt) - 1)):
        tokens, cached = serve(again, nxt, opts)
        assert cached == least
        assert tokens == rt.generate(nxt, opts).tokens
    again.stop()
    assert "warning" not in capfd.readouterr().err


def test_a_server_starts_over_files_it_cannot_use_saying_why(rt, stamp, written, tmp_path, capfd):
    blob, _ = written
    (tmp_path / "cut.turbo-state").write_bytes(blob[:-1])
    eng = engine(tmp_path)
    eng.stop()
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"warning: serve.state_dir: {tmp_path / 'cut.turbo-state'}: truncated ({len(blob) - 1} bytes, "
                   "shorter than its header declares); removed"]
    assert not list(tmp_path.glob("*.turbo-state"))


def test_the_state_keys_check_themselves(tmp_path):
    from turbo.serve.settings import ServeConfig, serve_config

    (tmp_path / "file").write_text("")
    with pytest.raises(TurboError, match=r"serve.state_dir=.*file', expected a directory"):
        ServeConfig(state_dir=str(tmp_path / "file"))
    with pytest.raises(TurboError, match=r"serve.state_gb=0, expected a number of GB > 0"):
        ServeConfig(state_gb=0)
    assert ServeConfig().state_dir is None
    conf = OmegaConf.load(Path(turbo.__file__).parent.parent / "conf" / "task" / "serve.yaml")
    conf.serve.state_dir, conf.serve.state_gb = str(tmp_path / "states"), 0.5
    assert (serve_config(conf).state_dir, serve_config(conf).state_gb) == (str(tmp_path / "states"), 0.5)


def test_a_saved_session_loaded_answers_as_the_original_and_a_cold_chat(rt, stamp, tmp_path):
    s = rt.session("You are terse.")
    list(s.send("Hello there", max_new_tokens=12, **DFLASH))
    path = tmp_path / "chat.turbo-state"
    assert s.save(path) == []
    loaded = rt.session().load(path)
    assert loaded.history == s.history
    mine = [t for ev in s.send("And more?", max_new_tokens=12, **DFLASH) for t in ev.tokens]
    theirs = [t for ev in loaded.send("And more?", max_new_tokens=12, **DFLASH) for t in ev.tokens]
    assert theirs == mine and loaded.last_turn.reused_tokens > 0
    assert (loaded.last_turn.resumed_from, loaded.last_turn.reused_tokens) == \
        (s.last_turn.resumed_from, s.last_turn.reused_tokens)
    assert rt.chat(s.history[:-1], max_new_tokens=12).tokens == mine
    sampled = dict(max_new_tokens=12, temperature=0.8, seed=11, **DFLASH)  # (the drafter's context restored too)
    again = rt.session().load(path)
    assert [t for ev in again.send("And more?", **sampled) for t in ev.tokens] == \
        [t for ev in s.retry(**sampled) for t in ev.tokens]
    # a file from other numerics is refused and the session is left as it was
    other = dataclasses.replace(stamp, numerics={**stamp.numerics, "kv_dtype": "float16"})
    data = json.loads(json.dumps(loaded.history))
    write_states(tmp_path / "other.turbo-state", other, [], {}, {"messages": "[]", "live": "null"})
    with pytest.raises(StateFileError, match="written under other numerics: kv_dtype"):
        loaded.load(tmp_path / "other.turbo-state")
    assert loaded.history == data


def test_a_server_process_stopped_by_ctrl_c_keeps_its_states_for_the_next(rt, tmp_path):
    """task=serve with serve.state_dir: Ctrl-C writes what is queued; the next server's first request
    that goes on from the answer is served from it, with the tokens the runtime gives."""
    def start():
        proc = subprocess.Popen([sys.executable, "-m", "turbo", "task=serve", "serve.port=0", "threads=1",
                                 "backend=cpu", "serve.front=inline", f"serve.state_dir={tmp_path / 'states'}"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return proc, served_address(proc).split()[-1]

    def complete(url: str, text: str) -> dict:
        body = json.dumps({"model": "tiny", "prompt": text, "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.load(r)

    def stop(proc) -> None:
        proc.send_signal(2)
        assert proc.wait(timeout=30) == 130
        assert "warning" not in proc.stderr.read()

    proc, url = start()
    first = complete(url, "def fib(n):")
    stop(proc)
    proc, url = start()
    text = "def fib(n):" + first["choices"][0]["text"] + "\n# and then"
    second = complete(url, text)
    stop(proc)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"][0]["text"] == rt.generate(text, max_new_tokens=8).text


def test_a_restarted_server_serves_a_new_users_question_from_the_system_prompt_on_disk(rt, tmp_path):
    """The states a chat request kept at its template's boundaries (here the system message) go to
    disk, and after a restart the first request that shares only that system prompt is served from
    them: cached_tokens at the boundary, the tokens a cold runtime gives."""
    from turbo.serve.protocol import parse

    system = {"role": "system", "content": "You answer questions about Python's standard library, briefly. " * 4}

    def request(eng, question: str):
        body = parse({"model": "tiny", "max_tokens": 10, "temperature": 0,
                      "messages": [system, {"role": "user", "content": question}]}, chat=True)
        prepared = eng.prepare(body)
        req = prepared.request
        tokens, cached = serve(eng, req.ids, req.options, req.marks)
        return prepared, tokens, cached

    first = engine(tmp_path / "states")
    prepared, _, cached = request(first, "What does os.path.join do?")
    (mark, kind), = ((m, k) for m, k in prepared.request.marks.items())
    assert kind == "system" and cached == 0
    first.stop()
    again = engine(tmp_path / "states")
    prepared, tokens, cached = request(again, "And shutil.copy?")
    again.stop()
    assert cached == mark  # (the state holds the rows before the system part's last token)
    assert tokens == rt.generate(prepared.request.ids, prepared.request.options).tokens

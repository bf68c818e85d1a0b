"""A server hostile clients cannot stop (issue 48): a body over serve.max_body_mb is a 413 as it
arrives, a prompt longer than the context could hold a 400 before the tokenizer runs, malformed
bodies (a lone surrogate echoed back, a template keyword named like a Python parameter, deep
nesting) a 4xx with OpenAI's error object, a named pipe or a NUL among image paths refused at once,
the API key from a file or the environment; under those attacks other clients' greedy answers
are unchanged. Templates are bounded in time and size. One server process (tiny, 1 MiB bodies)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from omegaconf import OmegaConf  # noqa: E402

import turbo  # noqa: E402
from turbo.chat import template as chat_template  # noqa: E402
from turbo.chat.template import ChatTemplate  # noqa: E402
from turbo.errors import TurboError  # noqa: E402
from turbo.serve import images  # noqa: E402
from turbo.serve.api_error import ApiError  # noqa: E402
from turbo.serve.settings import API_KEY_ENV, serve_config  # noqa: E402
from turbo.testing.checks import served_address  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PROMPT = "def fib(n):"
KEY = "k3y-from-a-file"
MESSAGES = [{"role": "user", "content": "Write a haiku."}]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "chatml.jinja").write_text(CHATML)
    (tmp / "key").write_text(KEY + "\n")
    cmd = [sys.executable, "-m", "turbo", "task=serve", "serve.port=0", "threads=1", "backend=cpu",
           f"serve.chat_template={tmp / 'chatml.jinja'}", "serve.max_body_mb=1", f"serve.api_key_file={tmp / 'key'}",
           "serve.max_running=4", "serve.http_nice=5"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's turbo, whatever the cwd
    env.pop(API_KEY_ENV, None)
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = served_address(proc)  # (stderr: stdout carries generated text alone)
    assert line.startswith("serving on http://127.0.0.1:"), line
    url = line.split()[-1]
    yield SimpleNamespace(url=url, proc=proc, headers={"Authorization": f"Bearer {KEY}"},
                          client=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120))
    proc.send_signal(2)
    assert proc.wait(timeout=30) == 130


@pytest.fixture(scope="module")
def want():
    rt = turbo.open("tiny", backend="cpu", threads=1)
    return SimpleNamespace(completion=rt.generate(PROMPT, max_new_tokens=8).text,
                           chat=rt.chat(MESSAGES, template=CHATML, max_new_tokens=8).message["content"])


def post(server, raw: bytes | object, route: str = "/v1/completions", **kw) -> httpx.Response:
    if not isinstance(raw, dict):  # bytes, or an iterator of chunks (sent chunked)
        return httpx.post(server.url + route, content=raw, headers=server.headers, timeout=120, **kw)
    return httpx.post(server.url + route, json=raw, headers=server.headers, timeout=120, **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_a_body_over_the_limit_is_a_413_as_it_arrives(server):
    big = json.dumps({"model": "tiny", "prompt": "x" * (2 << 20)}).encode()
    err = error_of(post(server, big), 413)
    assert "1 MiB limit (serve.max_body_mb)" in err["message"] and err["code"] == "request_too_large"
    chunked = (big[i:i + 65536] for i in range(0, len(big), 65536))  # no Content-Length: counted as read
    assert "serve.max_body_mb" in error_of(post(server, chunked), 413)["message"]


def test_a_prompt_longer_than_the_context_could_hold_is_refused_before_tokenizing(server):
    # tiny: 2048 positions, its longest token 33 characters, no normalizer: 67,584 characters at most
    start = time.monotonic()
    err = error_of(post(server, {"model": "tiny", "prompt": "ab " * 300_000, "max_tokens": 4}), 400)
    assert err["param"] == "prompt" and "900000 characters: more than this model's context of 2048" in err["message"]
    err = error_of(post(server, {"model": "tiny", "messages": [{"role": "user", "content": "ab " * 300_000}]},
                        "/v1/chat/completions"), 400)
    assert err["param"] == "messages[0].content" and "characters" in err["message"]
    err = error_of(post(server, {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "ab " * 150_000}, {"type": "text", "text": "cd " * 150_000}]}]},
        "/v1/chat/completions"), 400)
    assert err["param"] == "messages[0].content" and "900000 characters" in err["message"]
    assert time.monotonic() - start < 30


def raw_http(server, head: str, *parts: bytes, wait: float = 10.0) -> tuple[bytes, bool]:
    """Send a request's head (and `parts` of its body) over a socket, sending nothing more; what
    the server answers within `wait` seconds, and whether it then closed the connection (or reset
    it: closed with bytes of ours unread)."""
    import socket

    host, port = server.url.split("://")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        for part in parts:
            s.sendall(part)
        got, closed = b"", False
        try:
            while True:
                more = s.recv(65536)
                if not more:
                    closed = True
                    break
                got += more
        except ConnectionResetError:  # (closed with our unread bytes in its buffer: a reset)
            closed = True
        except socket.timeout:
            pass
    return got, closed


def test_an_over_limit_content_length_is_a_413_before_any_body_is_sent(server):
    """The 413 comes from the head alone (the client has sent no byte of its 2 MiB), and the
    server closes the connection rather than read or drain the body."""
    got, closed = raw_http(server, f"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {KEY}\n"
                                   f"Content-Type: application/json\nContent-Length: {2 << 20}\n")
    assert got.startswith(b"HTTP/1.1 413 "), got[:200]
    assert b"connection: close" in got.lower() and b"serve.max_body_mb" in got and closed


def test_a_chunked_body_is_cut_at_the_limit(server):
    """A chunked body is refused once its bytes pass the limit, its end never awaited, and the
    connection closed."""
    chunk = b"x" * 65536
    body = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(20))  # 1.25 MiB, no last chunk
    got, closed = raw_http(server, f"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {KEY}\n"
                                   "Content-Type: application/json\nTransfer-Encoding: chunked\n", body)
    assert got.startswith(b"HTTP/1.1 413 ") and closed, got[:200]


def test_a_missing_key_is_a_401_before_the_body(server):
    got, closed = raw_http(server, "POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: 100\n", wait=5)
    assert got.startswith(b"HTTP/1.1 401 ") and b"invalid_api_key" in got and closed, got[:200]


@pytest.mark.parametrize("raw, status, param", [
    (b'{"model": "\\udcff", "prompt": "x"}', 400, "model"),  # echoed in a 404 it would fail to encode
    (b'{"model": "tiny", "prompt": "\\ud800"}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": "x", "stop": ["\\udfff"]}', 400, "stop[0]"),
    (b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 200 + b"]" * 200 + b"}", 400,
     "user" + "[0]" * 64),
])
def test_malformed_bodies_are_a_4xx_naming_the_field(server, raw, status, param):
    assert error_of(post(server, raw), status)["param"] == param


def test_deep_message_fields_and_python_named_template_keywords(server, want):
    deep: object = "x"
    for _ in range(300):
        deep = {"a": deep}
    err = error_of(post(server, {"model": "tiny", "messages": [{**MESSAGES[0], "extra": deep}]},
                        "/v1/chat/completions"), 400)
    assert err["param"].startswith("messages[0].extra.a.a") and "nested more than 64 levels" in err["message"]
    for kwargs in ({"self": 1}, {"template": "t"}, {"source": 2}):  # (issue 57: refused as rt.chat refuses
        err = error_of(post(server, {"model": "tiny", "messages": MESSAGES,  # keywords the template does not read)
                                     "chat_template_kwargs": kwargs}, "/v1/chat/completions"), 400)
        assert err["param"] == f"chat_template_kwargs.{next(iter(kwargs))}", err
        r = server.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want.chat, kwargs
    err = error_of(post(server, {"model": "tiny", "messages": MESSAGES, "chat_template_kwargs": {"messages": 1}},
                        "/v1/chat/completions"), 400)
    assert err["param"] == "chat_template_kwargs.messages"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities: Linux")
def test_the_http_side_runs_nicer_than_the_engine(server):
    """serve.http_nice=5: the event loop's thread (the main one) and the threads it started are 5
    nicer than the engine's step thread, started before at the process's priority."""
    post(server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    nice = {}
    for tid in os.listdir(f"/proc/{server.proc.pid}/task"):
        with open(f"/proc/{server.proc.pid}/task/{tid}/stat") as f:
            nice[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert nice.pop(server.proc.pid) == base + 5 and base in nice.values(), nice


def test_the_key_comes_from_a_file_not_the_command_line(server):
    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"][0]["id"] == "tiny"


def test_other_clients_are_served_right_under_attack(server, want):
    """Attackers send over-limit bodies (declared and chunked) and prompts past the context, as fast
    as they are answered, while 4 clients ask; every client's greedy answer is the runtime's, and
    the attacks are all answered 4xx."""
    stop, statuses = threading.Event(), []
    big = json.dumps({"model": "tiny", "prompt": "x" * (3 << 20)}).encode()
    long_prompt = {"model": "tiny", "prompt": "ab " * 300_000, "max_tokens": 4}

    def attack(i: int) -> None:
        while not stop.is_set():
            raw = big if i % 3 == 0 else (big[j:j + 65536] for j in range(0, len(big), 65536)) if i % 3 == 1 \
                else long_prompt
            statuses.append(post(server, raw).status_code)

    def client(i: int) -> list[str]:
        out = []
        for _ in range(3):
            if i % 2:
                out.append(server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                                            temperature=0).choices[0].text)
            else:
                out.append(server.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                                                 temperature=0).choices[0].message.content)
        return out

    attackers = [threading.Thread(target=attack, args=(i,), daemon=True) for i in range(3)]
    for t in attackers:
        t.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(client, range(4)))
    finally:
        stop.set()
        for t in attackers:
            t.join(timeout=60)
    assert got == [[want.chat] * 3 if i % 2 == 0 else [want.completion] * 3 for i in range(4)]
    assert statuses and set(statuses) <= {400, 413}, set(statuses)
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_long_prompt_is_counted_in_pieces_and_never_tokenized_whole(monkeypatch):
    """Past COUNT_FROM characters a prompt is counted a piece at a time and refused once over the
    context (a real vocabulary's longest token makes the character bound loose): the pieces'
    counts are the whole's, and the engine never tokenizes the refused prompt whole."""
    from turbo.sequence.options import GenerationOptions, OpenOptions
    from turbo.serve import limits
    from turbo.serve.protocol import parse
    from turbo.serve.settings import ServeConfig
    from turbo.serve.worker import Engine

    engine = Engine("tiny", OpenOptions(backend="cpu", threads=1), GenerationOptions(), ServeConfig())
    tok = engine.rt.tokenizer
    text = "Hello world, this is a prompt; déjà vu — 数字 123. " * 8000  # 410,000 characters
    whole = len(tok.encode(text, add_special_tokens=False).ids)
    assert sum(len(tok.encode(p, add_special_tokens=False).ids) for p in limits.pieces(text)) == whole
    limits.check_prompt_tokens(tok, text, whole, "prompt")  # exactly the context: not refused
    engine.max_prompt_chars = 10**9  # (as a real vocabulary's bound: the characters alone do not refuse)
    monkeypatch.setattr(engine.rt, "encode", lambda *a: pytest.fail("tokenized whole"))
    with pytest.raises(ApiError) as e:
        engine.prepare(parse({"model": engine.model, "prompt": text, "max_tokens": 4}, chat=False))
    assert e.value.param == "prompt" and "holds more than 2048 tokens (counted before" in e.value.message


# ---- images: a pipe or a NUL among the allowed paths ------------------------------------------


def finishes(fn, seconds: float = 5.0):
    """fn()'s outcome (its value or its exception), or a failure if it runs past `seconds`."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 (the outcome is what is checked)
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return box[0] if box else pytest.fail(f"still running after {seconds} s")


def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    pipe = tmp_path / "pipe.png"
    os.mkfifo(pipe)
    try:
        out = finishes(lambda: images.image_source(f"file://{pipe}", "url", (str(tmp_path),)))
        assert isinstance(out, ApiError) and out.param == "url" and "is not a regular file" in out.message, out
    finally:  # (a reader still blocked in open, as before the fix, is let go)
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK) if _has_reader(pipe) else None
        if fd is not None:
            os.close(fd)


def _has_reader(pipe: Path) -> bool:
    try:
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        return True
    except OSError:
        return False


def test_a_nul_in_a_file_url_and_a_directory_are_400s(tmp_path):
    (tmp_path / "d").mkdir()
    for url, says in ((f"file://{tmp_path}/a%00.png", "a path with a NUL character"),
                      (f"file://{tmp_path}/d", "not a regular file")):
        out = finishes(lambda: images.image_source(url, "url", (str(tmp_path),)))
        assert isinstance(out, ApiError) and out.status == 400 and says in out.message, out


# ---- settings: the key from a file or the environment -------------------------------------------


def test_the_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch):
    base = OmegaConf.load(ROOT / "conf" / "task" / "serve.yaml")

    def config(**serve):
        return serve_config(OmegaConf.merge(base, {"serve": serve}))

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    (tmp_path / "key").write_text("s3cret\n")
    assert config(api_key_file=str(tmp_path / "key")).api_key == "s3cret"
    assert config().api_key is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert config().api_key == "from-env" and config(api_key="given").api_key == "given"
    (tmp_path / "empty").write_text("\n")
    for serve, says in (({"api_key": "a", "api_key_file": str(tmp_path / "key")}, "are both set"),
                        ({"api_key_file": str(tmp_path / "none")}, "serve.api_key_file=.*: not readable"),
                        ({"api_key_file": str(tmp_path / "empty")}, "the key is empty"),
                        ({"max_body_mb": 0}, "serve.max_body_mb=0, expected a number of MB > 0"),
                        ({"http_nice": 20}, "serve.http_nice=20, expected an integer in 0..19"),
                        ({"http_nice": -1}, "serve.http_nice=-1, expected an integer in 0..19")):
        with pytest.raises(TurboError, match=says):
            config(**serve)


# ---- templates: bounded in time and size ----------------------------------------------------------


@pytest.mark.parametrize("source, says", [
    ("{{ 'a' * 5000 }}", "a repetition of 1 x 5000"),
    ("{{ 'a'|center(5000) }}", "an argument of 5000"),
    ("{{ 'a'.ljust(5000) }}", "an argument of 5000"),
    ("{% set ns = namespace(s='xy') %}{% for i in range(20) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "a ~ concatenation"),
    ("{% set ns = namespace(s='xy') %}{% for i in range(20) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "a + of"),
    ("{% set ns = namespace(s='xy') %}{% for i in range(20) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}",
     "it built a value"),
    ("{% for i in range(500) %}{{ 'abcdefgh' }}{% endfor %}", "its output passed 1000 characters"),
    # three nested loops (10^9 iterations): two (10^6) can finish inside 0.2 s on an idle machine
    ("{% set xs = [0] * 999 %}{% for i in xs %}{% for j in xs %}{% for k in xs %}{% endfor %}{% endfor %}"
     "{% endfor %}", "it ran past 0.2 s"),
])
def test_templates_are_bounded_in_time_and_size(monkeypatch, source, says):
    monkeypatch.setattr(chat_template, "RENDER_CHARS", 1000)
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.2)
    with pytest.raises(TurboError) as e:
        ChatTemplate(source).render(MESSAGES)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_bounded_templates_render_as_before():
    source = ("{% for m in messages %}{{ loop.index ~ m.role ~ ':' ~ m.content }}{% if loop.last %}!{% endif %}"
              "{% else %}none{% endfor %}{{ 'ab' * 2 }}{{ [1, 2]|join(',') }}{{ 'ab'.replace('a', 'c') }}")
    assert ChatTemplate(source).render(MESSAGES + MESSAGES) == \
        "1user:Write a haiku.2user:Write a haiku.!abab1,2cb"
    assert ChatTemplate("{{ self is defined }}{{ template }}").render(MESSAGES, self=1, template="t") == "Truet"


def test_slow_image_requests_queue_apart_from_text_ones(monkeypatch):
    """A request with images is prepared in a pool of its own (app.IMAGE_WORKERS): twelve whose
    image reads hang leave a text request's preparation free to run at once (in asyncio's pool,
    which they used to fill)."""
    import asyncio

    from turbo.serve import app as served

    release = threading.Event()

    class Stalled:  # an engine whose image reads hang until released
        config = SimpleNamespace(api_key=None, max_body_mb=1)
        model, max_positions = "tiny", 64

        def check_chars(self, body) -> None:
            pass

        def prepare(self, body):
            if served.has_images(body):
                release.wait(10)
            raise ApiError("refused once prepared", "messages")

    monkeypatch.setattr(served, "_image_pool", None)
    app = served.make_app(Stalled())
    image = {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///slow.png"}}, {"type": "text", "text": "?"}]}]}
    text = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            slow = [asyncio.create_task(client.post("/v1/chat/completions", json=image)) for _ in range(12)]
            await asyncio.sleep(0.3)
            start = time.monotonic()
            answer = await client.post("/v1/chat/completions", json=text)
            took, stalled = time.monotonic() - start, not any(t.done() for t in slow)
            release.set()
            return answer, took, stalled, await asyncio.gather(*slow)

    try:
        answer, took, stalled, slow = asyncio.run(run())
    finally:
        release.set()
    assert answer.status_code == 400 and took < 5 and stalled, (answer.status_code, took, stalled)
    assert [r.status_code for r in slow] == [400] * 12

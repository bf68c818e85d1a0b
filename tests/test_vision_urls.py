"""Image URLs a served chat may send (turbo/serve/images.py): file:// ones only inside
serve.image_dirs (../ and symlink escapes refused, as is everything with no directory set), http(s)
ones only under serve.remote_images (fetched from a local http.server in a thread; a failed fetch,
an oversized body), each refusal a 400 naming the field and the option; through the official
`openai` client against the app in process, the answers those of the same image as a data: URL;
and serve.image_dirs / serve.remote_images checked in one line."""

from __future__ import annotations

import base64
import http.server
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from omegaconf import OmegaConf  # noqa: E402
from test_vision_doors import TEMPLATE, png  # noqa: E402

from turbo.errors import TurboError  # noqa: E402
from turbo.sequence.options import GenerationOptions, OpenOptions  # noqa: E402
from turbo.serve import images  # noqa: E402
from turbo.serve.settings import ServeConfig, serve_config  # noqa: E402
from turbo.testing.vision import make_vl_install  # noqa: E402

FIELD = "messages[0].content[0].image_url.url"
IMAGE = png(7, 40, 56)


@pytest.fixture(scope="module")
def web():
    """A local http.server serving /cat.png, /big.png (over the byte cap) and 404s, in a thread."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = {"/cat.png": IMAGE, "/big.png": b"\0" * (images.MAX_BYTES + 1)}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app in process on a VL install: image_dirs holds `allowed`; a secret lies next to it."""
    from fastapi.testclient import TestClient

    from turbo.serve.app import make_app
    from turbo.serve.worker import Engine

    tmp = tmp_path_factory.mktemp("urls")
    _, path = make_vl_install(tmp, seed=2)
    (tmp / "vl.jinja").write_text(TEMPLATE)
    allowed, outside = tmp / "allowed", tmp / "outside"
    allowed.mkdir(), outside.mkdir()
    (allowed / "cat.png").write_bytes(IMAGE)
    (outside / "secret.png").write_bytes(IMAGE)
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "up").symlink_to(outside)

    def client(**settings):
        config = ServeConfig(chat_template=str(tmp / "vl.jinja"), **settings)
        engine = Engine(str(path), OpenOptions(backend="cpu", threads=1), GenerationOptions(), config)
        engine.start()
        http = TestClient(make_app(engine))
        return engine, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)

    open_engine, open_client = client(image_dirs=(str(allowed),), remote_images=True)
    shut_engine, shut_client = client()
    yield SimpleNamespace(open=open_client, shut=shut_client, allowed=allowed, outside=outside, model=path.name)
    open_engine.stop(), shut_engine.stop()


def ask(client, model: str, url: str):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is it?"}]}]
    return client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)


def refused(client, model: str, url: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, model, url)
    err = e.value.body
    assert err["param"] == FIELD and says in err["message"], err


def test_allowed_file_and_remote_urls_answer_as_a_data_url(served, web):
    want = ask(served.open, served.model, "data:image/png;base64," + base64.b64encode(IMAGE).decode())
    want = want.choices[0].message.content
    assert want
    for url in (f"file://{served.allowed}/cat.png", f"file://{served.allowed}/../allowed/cat.png", f"{web}/cat.png"):
        assert ask(served.open, served.model, url).choices[0].message.content == want, url


def test_nothing_outside_the_allow_list_is_read(served):
    for url in (f"file://{served.outside}/secret.png", f"file://{served.allowed}/../outside/secret.png",
                f"file://{served.allowed}/link.png", f"file://{served.allowed}/up/secret.png",
                f"file://{served.allowed}/%2e%2e/outside/secret.png", "file:///etc/passwd"):
        refused(served.open, served.model, url, "lies outside serve.image_dirs")
    refused(served.open, served.model, f"file://{served.allowed}/missing.png", "not readable")
    refused(served.shut, served.model, f"file://{served.allowed}/cat.png", "reads no local image (serve.image_dirs")


def test_remote_urls_only_when_enabled(served, web):
    refused(served.shut, served.model, f"{web}/cat.png", "serve.remote_images=true fetches")
    refused(served.open, served.model, f"{web}/nope.png", "failed (Not Found)")
    refused(served.open, served.model, f"{web}/big.png", "over the 64 MiB image limit")
    refused(served.open, served.model, "http://127.0.0.1:1/x.png", "failed")
    with pytest.raises(openai.BadRequestError) as e:
        ask(served.open, served.model, "ftp://example.com/x.png")
    assert "is not a data:, file:// or http(s) URL" in e.value.body["message"]
    assert ask(served.open, served.model, f"{web}/cat.png").choices[0].message.content  # still serving


def test_the_settings_are_checked_in_one_line(tmp_path):
    base = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "task" / "serve.yaml")
    ok = serve_config(OmegaConf.merge(base, {"serve": {"image_dirs": [str(tmp_path)], "remote_images": True}}))
    assert ok.image_dirs == (str(tmp_path.resolve()),) and ok.remote_images
    for value, says in ((["/no/such/dir"], "serve.image_dirs: /no/such/dir is not a directory"),
                        (3, "serve.image_dirs=3, expected a list of directories")):
        with pytest.raises(TurboError, match=says):
            serve_config(OmegaConf.merge(base, {"serve": {"image_dirs": value}}))
    with pytest.raises(TurboError, match="serve.remote_images='yes', expected true or false"):
        serve_config(OmegaConf.merge(base, {"serve": {"remote_images": "yes"}}))


def test_a_named_pipe_among_the_images_is_refused_and_others_are_served(served):
    """A FIFO inside serve.image_dirs: opened without blocking and refused as not a regular file
    (it held the thread that read it for ever, and a few held every later chat request)."""
    import os
    import threading

    pipe = served.allowed / "pipe.png"
    os.mkfifo(pipe)
    try:
        out: list = []

        def attack() -> None:
            try:
                ask(served.open, served.model, f"file://{pipe}")
            except openai.BadRequestError as e:
                out.append(e.body)

        threads = [threading.Thread(target=attack, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(out) == 6 and all("is not a regular file" in e["message"] and e["param"] == FIELD for e in out)
        assert ask(served.open, served.model, f"file://{served.allowed}/cat.png").choices[0].message.content
    finally:
        pipe.unlink()

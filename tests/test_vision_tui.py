"""Images in the TUI's chat (tui/images.py) driven with Pilot on a small random VL install:
`/image PATH` typed in the box attaches an image to the next message, the transcript shows it
where it sits, and the turn's tokens are the API's for the same conversation; a missing file or
an install without a tower is one status line and the chat goes on."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("textual")

from test_tui import settle  # noqa: E402
from test_tui_chat import SIZE  # noqa: E402
from test_vision_doors import TEMPLATE, png  # noqa: E402

import turbo  # noqa: E402
from tui import Settings, TurboApp  # noqa: E402
from turbo.sequence.options import OpenOptions  # noqa: E402
from turbo.testing.vision import make_vl_install  # noqa: E402


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vltui")
    _, path = make_vl_install(tmp, seed=2)
    (tmp / "a.png").write_bytes(png(0, 40, 56))
    (tmp / "vl.jinja").write_text(TEMPLATE)
    return tmp, path, turbo.open(path, backend="cpu", threads=1)


async def enter(app, pilot, value: str) -> None:
    box = app.query_one("#prompt")
    box.focus()
    box.value = value
    await pilot.press("enter")
    await settle(app, pilot)


def test_an_image_attached_to_a_turn(vl):
    tmp, path, rt = vl
    settings = Settings(install=str(path), opening=OpenOptions.from_env(backend="cpu"),
                        chat_template=str(tmp / "vl.jinja")).with_(max_new_tokens=8, policy="off")
    image = str(tmp / "a.png")

    async def run():
        app = TurboApp(settings, runtime=rt)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            assert app.chat_on
            await enter(app, pilot, f"/image {tmp / 'nope.png'}")
            status = str(app.query_one("#status").content)
            assert "/image: " in status and "no such image file" in status and not app.attached
            await enter(app, pilot, f"/image {image}")
            assert len(app.attached) == 1 and app.query_one("#prompt").value == ""
            assert "attached" in str(app.query_one("#status").content)
            await enter(app, pilot, "what is this")
            assert app.last_outcome == "done", app.last_error
            s = app.session
            fresh = rt.chat([{"role": "user", "content": [{"type": "image", "image": image},
                                                           {"type": "text", "text": "what is this"}]}],
                            template=TEMPLATE, max_new_tokens=8, policy="off")
            assert s.last_turn.tokens == fresh.tokens and not app.attached
            assert str(app.query(".user-turn").first().content) == f"you [image {image}] what is this"
            await enter(app, pilot, "and now?")  # the image stays in the conversation
            assert app.last_outcome == "done", app.last_error
            again = rt.chat(s.history[:-1], template=TEMPLATE, max_new_tokens=8, policy="off")
            assert s.last_turn.tokens == again.tokens
            assert [str(w.content) for w in app.query(".user-turn")][1] == "you and now?"

    asyncio.run(run())


def test_no_tower_is_a_status_line():
    async def run():
        rt = turbo.open("tiny", backend="cpu", threads=1)
        app = TurboApp(Settings(install="tiny", opening=OpenOptions.from_env(backend="cpu")), runtime=rt)
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            assert app.chat_on
            await enter(app, pilot, "/image cat.png")
            assert "carries no vision tower" in str(app.query_one("#status").content)
            assert not app.attached and app.session.history == []

    asyncio.run(run())

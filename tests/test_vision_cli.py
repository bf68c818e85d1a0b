"""Images through the command line (turbo/vision): task=generate's `image=PATH` (one or a list)
answers as `generate(images=)` does, task=chat's `/image PATH` attaches an image to the next
turn as the API's session does; a missing file, a file that is no image, an install without a
tower and image= with another task are refused in one line (exit 2; in the chat, one line on
stderr and the conversation goes on)."""

from __future__ import annotations

import io

import pytest
from test_vision_doors import TEMPLATE, png

import turbo
from turbo.__main__ import cli
from turbo.chat_cli import Repl
from turbo.sequence.options import GenerationOptions
from turbo.testing.checks import run_clis
from turbo.testing.vision import make_vl_install

PROMPT = "what is this"


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlcli")
    _, path = make_vl_install(tmp, seed=2)
    (tmp / "a.png").write_bytes(png(0, 40, 56))
    (tmp / "b.png").write_bytes(png(1, 48, 32))
    (tmp / "notes.txt").write_text("not an image")
    (tmp / "vl.jinja").write_text(TEMPLATE)
    return tmp, path, turbo.open(path, backend="cpu", threads=1)


def test_image_keys_and_the_chat_command(vl):
    tmp, path, rt = vl
    base = ("threads=1", "backend=cpu", "+policy=off", "max_new_tokens=8", f"install.path={path}")
    two, chat = run_clis(tmp, [
        (f"prompt='{PROMPT}'", f"image=[{tmp / 'a.png'},{tmp / 'b.png'}]"),
        ("task=chat", f"chat_template={tmp / 'vl.jinja'}",
         f"/image {tmp / 'nope.png'}\n/image {tmp / 'a.png'}\n{PROMPT}\nand now?\n".encode()),
    ], base, text=True)
    want = rt.generate(PROMPT, images=[tmp / "a.png", tmp / "b.png"], max_new_tokens=8, policy="off")
    assert two.returncode == 0, two.stderr
    assert two.stdout == want.text and "generated 8 tok" in two.stderr.strip().splitlines()[-1]

    assert chat.returncode == 0, chat.stderr
    s = rt.session(template=TEMPLATE)
    want = ["".join(e.text for e in s.send(turn, max_new_tokens=8, policy="off"))
            for turn in ([{"type": "image", "image": str(tmp / "a.png")}, {"type": "text", "text": PROMPT}],
                         "and now?")]
    assert chat.stdout == "".join(w + "\n" for w in want)  # the answers alone; the stats lines on stderr
    err = chat.stderr.strip().splitlines()
    assert err[0].startswith("/image: ") and err[0].endswith("nope.png: no such image file")
    assert err[1].startswith(f"[image] {tmp / 'a.png'}")
    assert len([line for line in err if line.startswith("[stats]")]) == 2


def test_image_key_in_process_and_its_refusals(vl, capsys):
    tmp, path, rt = vl
    base = ["threads=1", "backend=cpu", "+policy=off", "max_new_tokens=8"]
    vl_path = f"install.path={path}"
    assert cli([*base, vl_path, f"prompt={PROMPT}", f"image={tmp / 'a.png'}"]) == 0
    want = rt.generate(PROMPT, images=[tmp / "a.png"], max_new_tokens=8, policy="off")
    said = capsys.readouterr()
    assert said.out == want.text and "[stats]" in said.err
    for over, says in (([vl_path, f"image={tmp / 'nope.png'}"], "nope.png: no such image file"),
                       ([vl_path, f"image={tmp / 'notes.txt'}"], "notes.txt: not a readable image"),
                       ([f"image={tmp / 'a.png'}"], "carries no vision tower"),  # tiny
                       ([vl_path, "task=chat", f"image={tmp / 'a.png'}"], "in task=chat type /image PATH")):
        assert cli([*base, "prompt=hi", *over]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err


def test_the_chat_command_on_an_install_without_a_tower_goes_on():
    rt = turbo.open("tiny", backend="cpu", threads=1)
    out, err = io.StringIO(), io.StringIO()
    repl = Repl(rt, rt.session(template=TEMPLATE), GenerationOptions(max_new_tokens=2, policy="off"), out=out, err=err)
    assert repl.run(["/image cat.png\n", "/image\n", "hi\n"]) == 0
    lines = err.getvalue().splitlines()
    assert "carries no vision tower" in lines[0] and "not a command here" in lines[1] and len(lines) == 3
    assert lines[2].startswith("[stats]") and "[stats]" not in out.getvalue() and not repl.images

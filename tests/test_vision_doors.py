"""Images through the Python API's doors (turbo/vision): `Runtime.chat` with OpenAI-style image
parts (image_url with a data: URL, image with a path) rendered by the chat template, equal to
`generate(images=)` over the same render; parts refused in one line."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

import turbo
from turbo.chat.template import encode
from turbo.errors import TurboError
from turbo.testing.vision import make_vl_install

TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if m.content is string %}{{ m.content }}"
            "{%- else %}{%- for item in m.content %}{%- if item.type in ('image', 'image_url') %}"
            "<|vision_start|><|image_pad|><|vision_end|>{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}"
            "{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
            "{%- endif %}")


def png(seed: int, h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    _, out = make_vl_install(tmp_path_factory.mktemp("vl"), seed=2)
    return turbo.open(out, backend="cpu")


def test_chat_with_image_parts_equals_generate(rt, tmp_path):
    (tmp_path / "b.png").write_bytes(png(1, 30, 20))
    url = "data:image/png;base64," + base64.b64encode(png(0, 40, 56)).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "look "},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " and "},
                                             {"type": "image", "image": str(tmp_path / "b.png")}]}]
    res = rt.chat(messages, template=TEMPLATE, max_new_tokens=12, policy="off")
    ids = encode(rt.tokenizer, turbo.chat.template.render(TEMPLATE, messages, add_generation_prompt=True))
    plain = rt.generate(ids, images=[url, tmp_path / "b.png"], max_new_tokens=12, policy="off")
    assert res.tokens == plain.tokens[:len(res.tokens)] and res.tokens
    spec = rt.chat(messages, template=TEMPLATE, max_new_tokens=12, policy="fixed", block=3, drafter="ngram")
    assert spec.tokens == res.tokens


def test_image_parts_refused_in_one_line(rt):
    text_only = "{%- for m in messages %}{{ m.role }}{%- endfor %}"
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(0, 40, 56)).decode()}}
    with pytest.raises(TurboError, match="placed 0 image placeholders for the messages' 1 images"):
        rt.chat([{"role": "user", "content": [part]}], template=text_only, max_new_tokens=2)
    with pytest.raises(TurboError, match="remote URLs are not fetched"):
        rt.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
                template=TEMPLATE, max_new_tokens=2)
    with pytest.raises(TurboError, match="without a url"):
        rt.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], template=TEMPLATE)


def test_placeholders_without_images_are_refused(rt):
    from turbo.testing.vision import END_ID, IMAGE_ID, START_ID

    with pytest.raises(TurboError, match="places an image .* with no image given"):
        rt.generate([5, START_ID, IMAGE_ID, END_ID, 6], max_new_tokens=2)
    session = rt.session(template=TEMPLATE)
    with pytest.raises(TurboError, match="chat session's turn places an image"):
        list(session.send("typed <|vision_start|><|image_pad|><|vision_end|>", max_new_tokens=2))


@pytest.mark.parametrize("spec", [dict(policy="off"), dict(policy="fixed", block=2, drafter="ngram")])
def test_a_session_with_an_image_in_turn_3_of_5_equals_fresh_generations(rt, spec):
    url = "data:image/png;base64," + base64.b64encode(png(3, 40, 56)).decode()
    turns = ["hello", "more", [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": url}}],
             "and then", "end"]
    session = rt.session(template=TEMPLATE)
    for i, content in enumerate(turns):
        list(session.send(content, max_new_tokens=6, **spec))
        fresh = rt.chat(session.history[:-1], template=TEMPLATE, max_new_tokens=6, policy="off")
        assert session.last_turn.tokens == fresh.tokens and fresh.tokens
        if i > 2:  # past the image the state goes on: only the turn's new rows (tests/test_vision_reuse.py)
            report = session.last_turn
            assert report.resumed_from != "fresh" and report.prefilled_tokens < report.prompt_tokens // 2
    assert session.history[4]["content"] == turns[2]


def test_an_install_without_a_tower_refuses_images():
    rt = turbo.open("tiny", backend="cpu")
    with pytest.raises(TurboError, match="carries no vision tower"):
        rt.generate("hi", images=[png(0, 40, 56)], max_new_tokens=2)
    with pytest.raises(TurboError, match="images of type str: expected a list"):
        rt.generate("hi", images="cat.png", max_new_tokens=2)
    assert rt.generate("hi", images=[], max_new_tokens=2).tokens  # none: a plain generation

"""Images through the server (turbo/serve/images.py): the official `openai` client against a real
server process on a small random VL install: image_url parts with data: URLs answered as the
Python API answers them alone (in a batch, streamed or not, with speculation), two requests with
the same text and different images each their own answer (the prefix cache never mixes them),
and remote URLs and malformed images refused with a 400 naming the field while it keeps serving."""

import base64
import io
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from test_vision_doors import TEMPLATE, png  # noqa: E402

import turbo  # noqa: E402
from turbo.testing.checks import served_address  # noqa: E402
from turbo.testing.vision import IMAGE_ID, make_vl_install  # noqa: E402


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def solid(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((40, 56, 3), value, dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


# the same size: their requests' token ids are the same, their answers not
IMAGES = [data_url(solid(0)), data_url(solid(255))]


def ask(url: str, text: str = "What is it?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlserve")
    _, path = make_vl_install(tmp, seed=2)
    (tmp / "vl.jinja").write_text(TEMPLATE)
    cmd = [sys.executable, "-m", "turbo", "task=serve", "serve.port=0", "threads=1", "backend=cpu",
           f"install.path={path}", f"serve.chat_template={tmp / 'vl.jinja'}", "serve.max_running=4"]
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = served_address(proc)  # (stderr: stdout carries generated text alone)
    assert line.startswith("serving on http://127.0.0.1:"), line
    url = line.split()[-1]
    yield SimpleNamespace(client=openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
                          rt=turbo.open(path, backend="cpu", threads=1), model=path.name)
    proc.send_signal(2)
    assert proc.wait(timeout=30) == 130


def chat(vl, messages, **kw):
    return vl.client.chat.completions.create(model=vl.model, messages=messages, max_tokens=10, temperature=0, **kw)


def test_image_requests_answer_as_the_api_alone_batched_or_not(vl):
    want = [vl.rt.chat(ask(u), template=TEMPLATE, max_new_tokens=10, policy="off").message["content"] for u in IMAGES]
    text_only = [{"role": "user", "content": "What is it?"}]
    plain = vl.rt.chat(text_only, template=TEMPLATE, max_new_tokens=10, policy="off").message["content"]
    assert want[0] != want[1]  # the images decide the answer
    for _ in range(2):  # the second time round, a prefix cache keyed by token ids alone would mix them up
        assert [chat(vl, ask(u)).choices[0].message.content for u in IMAGES] == want
    with ThreadPoolExecutor(4) as pool:  # in one batch, with a text request and a speculating one
        jobs = [pool.submit(chat, vl, ask(u)) for u in IMAGES] + [pool.submit(chat, vl, text_only)]
        jobs.append(pool.submit(chat, vl, ask(IMAGES[1]), extra_body={"turbo": {"drafter": "ngram", "block": 3}}))
        got = [j.result().choices[0].message.content for j in jobs]
    assert got == want + [plain, want[1]]
    streamed = chat(vl, ask(IMAGES[0]), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want[0]
    r = chat(vl, ask(IMAGES[0]))
    assert r.usage.prompt_tokens == vl.rt.chat(ask(IMAGES[0]), template=TEMPLATE, max_new_tokens=1).stats.prompt_tokens


@pytest.mark.parametrize("url, says", [
    ("https://example.com/cat.png", "is not a data: URL"),
    ("data:image/png;base64," + base64.b64encode(png(0, 40, 56)[:60]).decode(), "truncated|corrupt|cannot"),
    ("data:image/png;base64,not*base64!", "base64"),
])
def test_bad_images_are_a_400_naming_the_field_and_it_keeps_serving(vl, url, says):
    messages = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(vl, messages)
    err = e.value.body
    assert err["param"] == "messages[0].content[1].image_url.url", err
    assert re.search(says, err["message"]), err["message"]
    assert chat(vl, ask(IMAGES[1])).choices[0].message.content  # still serving


def test_the_scheduler_batches_image_requests_on_both_steps(tmp_path, step_path):
    """In process, native and torch steps: image requests (two images that give the same ids) and
    text ones in one batch, greedy and speculating, each equal to generate(images=) alone."""
    from test_scheduler import Collect, drain

    from turbo.chat.template import encode, render
    from turbo.sequence.options import GenerationOptions as G
    from turbo.serve.images import expand_images
    from turbo.serve.scheduler import Request, Scheduler, ServeLimits

    _, path = make_vl_install(tmp_path, seed=2)
    rt = turbo.open(path, backend="cpu", threads=1)
    reqs, want = [], []
    for url, spec in [(IMAGES[0], dict(policy="off")), (IMAGES[1], dict(policy="off")), (None, dict(policy="off")),
                      (IMAGES[1], dict(policy="fixed", block=3, drafter="ngram")), (IMAGES[0], dict(policy="off"))]:
        messages = ask(url) if url else [{"role": "user", "content": "What is it?"}]
        ids = encode(rt.tokenizer, render(TEMPLATE, messages, add_generation_prompt=True))
        want.append(rt.generate(ids, images=[url] if url else None, max_new_tokens=10, **spec).tokens)
        expanded, images = expand_images(rt, messages, ids)
        reqs.append(Request(expanded, G(max_new_tokens=10, **spec), images=images or None))
    sched = Scheduler(rt, ServeLimits(prefill_chunk=16))
    sinks = [Collect() for _ in reqs]
    for r, s in zip(reqs, sinks):
        sched.submit(r, s)
    drain(sched, sinks)
    assert [s.error for s in sinks] == [None] * len(reqs)
    assert [s.tokens for s in sinks] == want and want[0] != want[1]
    # the cache (the native step's) keeps the image requests' states too, their image rows tagged by image
    assert bool(sched.cache.entries) == sched.chunked
    row = reqs[0].ids.index(IMAGE_ID)
    tags = {k[row] for k in sched.cache.entries if len(k) > row and isinstance(k[row], tuple)}
    assert len(tags) == (2 if sched.chunked else 0)


def conversation(url: str, answers: list[str], turn: int) -> list[dict]:
    """A 3-turn chat with an image in turn 1, as its turn `turn` (0-based) resends it."""
    messages = ask(url)
    for i, text in enumerate(["And the colour?", "Say it again."][:turn]):
        messages = messages + [{"role": "assistant", "content": answers[i]}, {"role": "user", "content": text}]
    return messages


def test_a_resent_conversation_with_images_hits_the_prefix_cache(vl):
    """Each turn resent whole: the answers a cold run gives, the rows up to the last answer cached
    from turn 2 on; the same text with another image gets its own answers, no hit past the image."""
    from turbo.chat.template import encode, render

    pair = [data_url(solid(64)), data_url(solid(192))]  # not sent before
    first = []
    for url in pair:
        answers = []
        for turn in range(3):
            messages = conversation(url, answers, turn)
            r = chat(vl, messages)
            cold = vl.rt.chat(messages, template=TEMPLATE, max_new_tokens=10, policy="off")
            assert r.choices[0].message.content == cold.message["content"], (url[-8:], turn)
            answers.append(r.choices[0].message.content)
            cached = r.usage.prompt_tokens_details.cached_tokens
            ids = encode(vl.rt.tokenizer, render(TEMPLATE, messages, add_generation_prompt=True))
            if turn:  # past the image: the last turn's state
                assert cached > ids.index(IMAGE_ID), (url[-8:], turn)
            else:  # the first's states hold another image at the same place: nothing past it
                assert cached <= ids.index(IMAGE_ID)
        first.append(answers)
    assert first[0] != first[1]


def test_a_shared_first_turn_with_an_image_serves_the_next_users_question(vl):
    """Users who share a first turn with an image in it (and its answer), then ask different
    questions: the first request keeps the state at the turn's boundary (counted in expanded rows,
    past the image), the next ones go on from it, and every answer is the cold engine's, plain and
    speculating."""
    from turbo.chat.template import encode, render
    from turbo.serve.images import expand_images, image_rows
    from turbo.vision.positions import expanded_row

    url = data_url(solid(96))  # not sent before
    head = ask(url, "Describe it.") + [{"role": "assistant", "content": "A flat grey square."}]
    text = render(TEMPLATE, [*head, {"role": "user", "content": "NEXT"}], add_generation_prompt=False)
    part = encode(vl.rt.tokenizer, text[:text.index("NEXT")])
    _, prepared = expand_images(vl.rt, head, part)
    counts, image_id = image_rows(vl.rt, prepared)
    boundary = expanded_row(part, counts, image_id, len(part)) - 1  # (the part's last token: the anchor)
    cached = []
    for q, spec in [("And its colour?", {}), ("Is it round?", {}),
                    ("How big is it?", {"policy": "fixed", "drafter": "ngram", "block": 3})]:
        messages = [*head, {"role": "user", "content": q}]
        r = chat(vl, messages, extra_body={"turbo": spec} if spec else None)
        cold = vl.rt.chat(messages, template=TEMPLATE, max_new_tokens=10, **(spec or {"policy": "off"}))
        assert r.choices[0].message.content == cold.message["content"], q
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] <= part.index(IMAGE_ID)  # the image is new: nothing past it
    assert cached[1:] == [boundary, boundary] and boundary > part.index(IMAGE_ID) + counts[0]

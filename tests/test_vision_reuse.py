"""A chat session keeps its state past images (turbo/chat/image_session.py): after a turn with an
image, each later turn prefills only its new rows (a new image's through the image prefill of
just its rows), and every turn's tokens equal a fresh generation over the conversation: greedy and
speculating (ngram, dflash, mtp), an image in turn 3 and images in turns 3 and 5; an edited turn
with another image in it goes on from before it; the torch step prefills every turn afresh."""

from __future__ import annotations

import base64

import pytest
from test_vision_doors import TEMPLATE, png
from test_vision_speculation import own_drafters  # noqa: F401 (the fixture)

import turbo
from turbo.chat.session import common_prefix
from turbo.chat.template import encode, render
from turbo.testing.vision import make_vl_install
from turbo.vision.runtime import message_images, vision_of


def image(seed: int, h: int = 40, w: int = 56) -> list:
    url = "data:image/png;base64," + base64.b64encode(png(seed, h, w)).decode()
    return [{"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": url}}]


def expanded(rt, messages: list, generation_prompt: bool = True) -> list[int]:
    """The prompt's rows: the render's ids with each image's placeholder expanded."""
    ids = encode(rt.tokenizer, render(TEMPLATE, messages, add_generation_prompt=generation_prompt))
    return vision_of(rt).prompt(ids, message_images(messages))[0]


def converse(rt, turns: list, **spec) -> list:
    """Each turn equal to a fresh generation over the conversation; the reports."""
    session, reports = rt.session(template=TEMPLATE), []
    for content in turns:
        list(session.send(content, max_new_tokens=6, **spec))
        fresh = rt.chat(session.history[:-1], template=TEMPLATE, max_new_tokens=6, policy="off")
        assert session.last_turn.tokens == fresh.tokens and fresh.tokens, (len(reports), spec)
        asked = session.history[:-1]
        reports.append((session.last_turn, expanded(rt, asked), expanded(rt, asked, False)))
    return reports


def check_reuse(reports: list, first_image: int) -> None:
    """From the turn after the first image on, only the new rows are prefilled."""
    for i in range(first_image + 1, len(reports)):
        (prev, prev_ids, prev_bare), (report, ids, _) = reports[i - 1], reports[i]
        held = prev_ids + prev.tokens
        assert report.prompt_tokens == len(ids) and report.resumed_from != "fresh"
        if ids[:len(held)] == held:  # the answer re-encodes to its tokens
            assert report.resumed_from == "last turn" and report.reused_tokens == len(held) - 1
        else:  # from the snapshot at the start of the last answer's generation prompt
            assert report.resumed_from == "snapshot" and report.reused_tokens == common_prefix(prev_ids, prev_bare)
        assert report.prefilled_tokens == len(ids) - 1 - report.reused_tokens


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    _, out = make_vl_install(tmp_path_factory.mktemp("vl"), seed=2)
    return turbo.open(out, backend="cpu")


SPECS = [dict(policy="off"), dict(policy="fixed", block=2, drafter="ngram"),
         dict(policy="fixed", block=3, drafter="ngram", rollback="replay")]


@pytest.mark.parametrize("spec", SPECS)
def test_turns_after_an_image_prefill_only_their_rows(rt, spec):
    check_reuse(converse(rt, ["hello", "more", image(3), "and then", "end"], **spec), 2)


@pytest.mark.parametrize("spec", SPECS[:2])
def test_a_new_image_in_a_later_turn_prefills_only_its_rows(rt, spec):
    reports = converse(rt, ["hello", "more", image(3), "and then", image(4, 30, 20)], **spec)
    check_reuse(reports, 2)
    vis = vision_of(rt)
    assert reports[4][1].count(vis.ids.image) > reports[3][1].count(vis.ids.image)  # turn 5's image rows are new


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_own_drafters_reuse_past_images(own_drafters, kind):  # noqa: F811
    spec = dict(policy="fixed", block=3, drafter=kind)
    check_reuse(converse(own_drafters, ["hello", "more", image(3), "and then", image(4, 30, 20)], **spec), 2)


def test_an_edited_image_is_not_taken_for_the_old_one(rt):
    session = rt.session(template=TEMPLATE)
    for content in ("hello", image(3), "and then"):
        list(session.send(content, max_new_tokens=6, policy="off"))
    list(session.edit(2, image(5), max_new_tokens=6, policy="off"))  # the same rows' ids, another image
    fresh = rt.chat(session.history[:-1], template=TEMPLATE, max_new_tokens=6, policy="off")
    report = session.last_turn
    assert report.tokens == fresh.tokens and report.resumed_from == "snapshot"
    assert report.reused_tokens < expanded(rt, session.history[:3]).index(vision_of(rt).ids.image)


def test_the_torch_step_prefills_every_turn_afresh(rt):
    torch_rt = turbo.open(rt.install.path, backend="cpu", native=False)
    reports = converse(torch_rt, ["hello", image(3), "end"], policy="fixed", block=2, drafter="ngram")
    assert all(r.resumed_from == "fresh" and r.prefilled_tokens == len(ids) - 1 for r, ids, _ in reports)

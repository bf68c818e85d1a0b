"""Images in served chat requests: OpenAI's image_url content parts with data: URLs (protocol.py
checks their shape and refuses any other URL).

When a request is prepared (worker.Engine.prepare, before the answer's first byte) each image is
decoded and checked (a malformed one is a 400 naming its field: `messages[i].content[j].image_url.url`)
and the template's placeholder for it expanded to the image's tokens, so the request's ids have
their real length. At admission the scheduler prefills the whole prompt at once through the API's
image prefill (turbo/vision/runtime.prefill_images: the tower's rows and their multimodal
positions), then the sequence decodes in the batch like any other, its state's rope_delta rotating
its rows: its tokens are those the same request alone through the API gives.

The prefix cache keeps an image request's states as a text one's, keyed by its ids with each
image row tagged by its image's identity (`cache_key`: the grid and the sha256 of the prepared
pixels), since every image's placeholder ids are the same whatever the image holds: a resent
conversation with the same images goes on from its kept state (the rows after it through the image
prefill of just them), one with another image in the same place only from before that image.
"""

from __future__ import annotations

from ..errors import TurboError
from ..vision.image import PreparedImage
from ..vision.positions import expand_placeholders
from ..vision.runtime import check_placed, keyed_rows, prefill_images, vision_of


def image_urls(messages: list[dict]) -> list[tuple[str, str]]:
    """(url, the field that holds it) for each image_url part, in order (protocol._parts' form)."""
    return [(part["image_url"]["url"], f"messages[{i}].content[{j}].image_url.url")
            for i, m in enumerate(messages) if isinstance(m.get("content"), list)
            for j, part in enumerate(m["content"]) if part["type"] == "image_url"]


def expand_images(rt, messages: list[dict], ids: list[int]) -> tuple[list[int], list[PreparedImage]]:
    """The rendered prompt's ids with each image's placeholder expanded, and the images decoded
    (none: `ids` as they are)."""
    from .protocol import ApiError  # (protocol imports the scheduler, which imports this module)

    urls = image_urls(messages)
    if not urls:
        return ids, []
    try:
        vis = vision_of(rt)
        check_placed(rt, ids, urls)
    except TurboError as e:
        raise ApiError(str(e), "messages") from None
    prepared = []
    for url, param in urls:
        try:
            prepared.append(vis.prepare([url])[0])
        except TurboError as e:
            raise ApiError(f"{param}: {e}", param) from None
    return expand_placeholders(ids, [p.tokens(vis.config.merge) for p in prepared], vis.ids.image), prepared


def prefill_request(rt, st, ids: list[int], images: list[PreparedImage], aux_layers: tuple[int, ...],
                    start: int = 0):
    """A request's prompt with its images into its state, which holds ids[:start] (0: fresh; else
    from the prefix cache) at the scheduler's admission: the tower's rows (kept by content for the
    last few images), then the API's image prefill of the rows after `start` (None: none left)."""
    _, mm = vision_of(rt).prompt(ids, images, expand=False)
    return prefill_images(rt.trunk, st, ids, mm, aux_layers, start)


def cache_key(rt, tokens: list[int], images: list[PreparedImage] | None) -> list:
    """What the prefix cache keys a request's state by: its ids, image rows tagged by their image."""
    return keyed_rows(tokens, images, vision_of(rt).ids.image) if images else tokens

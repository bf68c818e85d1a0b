"""Images in served chat requests: OpenAI's image_url content parts (protocol.py checks their
shape): data: URLs; file:// URLs whose real path (symlinks and ../ resolved) lies inside one of
serve.image_dirs (none by default); http(s) URLs fetched only under serve.remote_images=true, within
FETCH_TIMEOUT_S and image.py's MAX_BYTES (its pixel budget is checked on the header, as for any
image). Any other is a 400 naming the field and the option that would allow it.

When a request is prepared (worker.Engine.prepare, before the answer's first byte) each image is
decoded and checked (a malformed one is a 400 naming its field: `messages[i].content[j].image_url.url`)
and the template's placeholder for it expanded to the image's tokens, so the request's ids have
their real length. At admission the scheduler starts its driver with the prompt's images as the
trunk takes them (turbo/vision/runtime.prompt_images: the tower's rows and their multimodal
positions), which prefills the prompt's rest at once (Driver.start), then the sequence decodes in
the batch like any other, its state's rope_delta rotating its rows: its tokens are those the same
request alone through the API gives.

The prefix cache keeps an image request's states as a text one's, keyed by its ids with each
image row tagged by its image's identity (PromptImages.keyed: the grid and the sha256 of the
prepared pixels), since every image's placeholder ids are the same whatever the image holds: a resent
conversation with the same images goes on from its kept state (the rows after it through the image
prefill of just them), one with another image in the same place only from before that image.
"""

from __future__ import annotations

import os
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException

from ..errors import TurboError
from ..vision.image import MAX_BYTES, PreparedImage
from ..vision.positions import expand_placeholders
from ..vision.runtime import check_placed, vision_of
from .api_error import ApiError


def image_urls(messages: list[dict]) -> list[tuple[str, str]]:
    """(url, the field that holds it) for each image_url part, in order (protocol._parts' form)."""
    return [(part["image_url"]["url"], f"messages[{i}].content[{j}].image_url.url")
            for i, m in enumerate(messages) if isinstance(m.get("content"), list)
            for j, part in enumerate(m["content"]) if part["type"] == "image_url"]


FETCH_TIMEOUT_S = 10.0  # a remote image's whole fetch (serve.remote_images)


def image_source(url: str, param: str, dirs: tuple[str, ...] = (), remote: bool = False) -> str | bytes:
    """What a request's image URL lets the server decode: a data: URL as it is, a file's or a
    fetched image's bytes; refused (an ApiError naming `param`) unless the settings allow it."""
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return url
    if scheme == "file":
        return _local(url, param, dirs)
    if not remote:
        raise ApiError(f"{param}: {url[:60]!r} is not a data: URL, and this server fetches no remote image "
                       "(serve.remote_images=true fetches http(s) URLs)", param)
    deadline, chunks, size = time.monotonic() + FETCH_TIMEOUT_S, [], 0
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "turbo"}),
                                    timeout=FETCH_TIMEOUT_S) as r:
            while chunk := r.read(1 << 16):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_BYTES:
                    raise ApiError(f"{param}: {url[:80]!r} is over the {MAX_BYTES >> 20} MiB image limit", param)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not fetched within {FETCH_TIMEOUT_S:g} s")
    except (urllib.error.URLError, HTTPException, OSError, ValueError) as e:
        raise ApiError(f"{param}: fetching {url[:80]!r} failed ({getattr(e, 'reason', None) or e})", param) from None
    return b"".join(chunks)


def _local(url: str, param: str, dirs: tuple[str, ...]) -> bytes:
    """A file:// URL's bytes, read only where its real path lies inside one of `dirs`."""
    allow = "serve.image_dirs=[DIR,...] lists the directories file:// URLs may name"
    if not dirs:
        raise ApiError(f"{param}: this server reads no local image ({allow})", param)
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ApiError(f"{param}: {url[:60]!r}: a file:// URL names a file on this host (file:///PATH)", param)
    path = urllib.parse.unquote(parts.path)
    if "\0" in path:  # (os.path.realpath raises ValueError on it)
        raise ApiError(f"{param}: {url[:60]!r}: a path with a NUL character names no file", param)
    real = os.path.realpath(path)
    roots = [os.path.realpath(d) for d in dirs]
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise ApiError(f"{param}: {url[:60]!r} lies outside serve.image_dirs ({allow})", param)
    return _read_regular(real, url, param)


READ_TIMEOUT_S = 10.0  # a local image's whole read (a slow network file system must not hold a worker longer)


def _read_regular(real: str, url: str, param: str) -> bytes:
    """A regular file's bytes, at most MAX_BYTES, read within READ_TIMEOUT_S. Opened without
    blocking (O_NONBLOCK: opening a named pipe nobody writes would wait forever, and a few such
    requests would hold every thread that prepares requests) and refused unless fstat says it is
    a regular file (a pipe, a device, a socket: /dev/zero never ends)."""
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ApiError(f"{param}: {url[:60]!r}: not readable ({e.strerror or e})", param) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ApiError(f"{param}: {url[:60]!r} is not a regular file", param)
        if st.st_size > MAX_BYTES:
            raise ApiError(f"{param}: {url[:60]!r} is over the {MAX_BYTES >> 20} MiB image limit", param)
        deadline, chunks, size = time.monotonic() + READ_TIMEOUT_S, [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_BYTES:  # (it grew since fstat)
                raise ApiError(f"{param}: {url[:60]!r} is over the {MAX_BYTES >> 20} MiB image limit", param)
            if time.monotonic() > deadline:
                raise ApiError(f"{param}: {url[:60]!r}: not read within {READ_TIMEOUT_S:g} s", param)
    except OSError as e:
        raise ApiError(f"{param}: {url[:60]!r}: not readable ({e.strerror or e})", param) from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def image_rows(rt, prepared: list[PreparedImage]) -> tuple[list[int], int]:
    """The rows each prepared image takes in the prompt, and the placeholder's id."""
    vis = vision_of(rt)
    return [p.tokens(vis.config.merge) for p in prepared], vis.ids.image


def expand_images(rt, messages: list[dict], ids: list[int], dirs: tuple[str, ...] = (),
                  remote: bool = False) -> tuple[list[int], list[PreparedImage]]:
    """The rendered prompt's ids with each image's placeholder expanded, and the images read (as
    serve.image_dirs and serve.remote_images allow: image_source) and decoded (none: `ids` as
    they are)."""
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
        source = image_source(url, param, dirs, remote)
        try:
            prepared.append(vis.prepare([source])[0])
        except TurboError as e:
            raise ApiError(f"{param}: {e}", param) from None
    counts, image_id = image_rows(rt, prepared)
    return expand_placeholders(ids, counts, image_id), prepared

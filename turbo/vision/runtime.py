"""An install's vision side as the runtime uses it: the tower (tower.py), the processor's
settings (image.py), the multimodal token ids and rotary sections (config.py), and `prompt`,
which turns a token prompt with one placeholder per image into the trunk's rows and MmRows."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from ..errors import TurboError
from ..store.install import Install
from .config import TokenIds, VisionConfig, mrope_section, token_ids, vision_config
from .image import ImageInput, ImageSpec, PreparedImage, prepare, spec_from_files
from .positions import MmRows, PromptImages, expand_placeholders, mm_rows
from .tower import TowerWeights, check_tensors, encode, install_names, tower_from_install

ENCODED = 16  # images whose tower rows a runtime keeps


@dataclass
class Vision:
    config: VisionConfig
    weights: TowerWeights
    ids: TokenIds
    sections: tuple[int, int, int]
    rot_half: int
    spec: ImageSpec
    _encoded: dict = field(default_factory=dict, repr=False)  # (grid, pixels' sha256) -> the tower's rows

    @classmethod
    def from_install(cls, install: Install, device: torch.device | str = "cpu") -> "Vision":
        if not install.has_vision:
            raise TurboError(f"{install.name}: this install carries no vision tower (repacked --text-only, or text-only)")
        where = str(install.path / "config.json")
        a = install.arch
        c = vision_config(install.config, a.hidden, where)
        return cls(c, tower_from_install(install, c, device), token_ids(install.config, a.vocab, where),
                   mrope_section(install.config, where), a.rotary_dim // 2,
                   spec_from_files(install.path, c.patch, c.merge, c.temporal))

    def prepare(self, images: list[ImageInput | PreparedImage]) -> list[PreparedImage]:
        return [im if isinstance(im, PreparedImage) else prepare(im, self.spec) for im in images]

    def prompt(self, tokens: list[int], images: list[ImageInput | PreparedImage],
               expand: bool = True) -> tuple[list[int], MmRows]:
        """`tokens` with each image placeholder expanded to its image's tokens (expand=False:
        already expanded), and the trunk's MmRows for them."""
        prepared = self.prepare(images)
        grids = [p.grid for p in prepared]
        if expand:
            tokens = expand_placeholders(tokens, [p.tokens(self.config.merge) for p in prepared], self.ids.image)
        embeds = torch.cat([self.encode(p) for p in prepared]) if prepared else torch.empty(0, self.config.out_hidden)
        return tokens, mm_rows(tokens, grids, embeds, self.config.merge, self.ids.image, self.sections, self.rot_half)

    def encode(self, image: PreparedImage) -> torch.Tensor:
        """The tower's rows for one image, kept for the last ENCODED images by content (a chat
        session sends its conversation's images again every turn)."""
        key = image_key(image)
        if key not in self._encoded:
            if len(self._encoded) >= ENCODED:
                self._encoded.pop(next(iter(self._encoded)))
            self._encoded[key] = encode(self.config, self.weights, image.pixels, [image.grid])
        return self._encoded[key]


def image_key(image: PreparedImage) -> tuple:
    """An image's identity as the trunk sees it: its grid and the sha256 of its prepared pixels
    (a session's kept states and the server's prefix cache tell images apart by it)."""
    key = getattr(image, "_key", None)
    if key is None:
        key = image._key = (image.grid, hashlib.sha256(image.pixels.numpy().tobytes()).hexdigest())
    return key


def keyed_rows(tokens: list[int], images: list[PreparedImage], image_id: int) -> list:
    """`tokens` (placeholders expanded) with each image row tagged by its image's identity, so
    two prompts match row by row only where their images are the same."""
    out, keys = list(tokens), iter(image_key(p) for p in images)
    key = None
    for i, t in enumerate(tokens):
        if t == image_id:
            if key is None or tokens[i - 1] != image_id:
                key = next(keys, None)  # (None: a placeholder past the images, a generated one)
            out[i] = (t, key)
    return out


def tower_refusal(install: Install) -> str | None:
    """Why this install's tower cannot run (its config and its tensors' shapes, read off the
    index: nothing loads), or None."""
    where = str(install.path / "config.json")
    try:
        c = vision_config(install.config, install.arch.hidden, where)
        token_ids(install.config, install.arch.vocab, where)
        mrope_section(install.config, where)
        check_tensors(c, install_names(install), lambda n: install.index.need(n).dims)
    except TurboError as e:
        return str(e)
    return None


def vision_of(rt) -> Vision:
    """The runtime's Vision, built on first use (the tower loads with the first image)."""
    if getattr(rt, "_vision", None) is None:
        rt._vision = Vision.from_install(rt.install)
    return rt._vision


def prompt_images(rt, tokens: list[int], images: list) -> PromptImages:
    """A prompt's images as the trunk takes them: `tokens` hold each image's placeholder expanded
    already (vis.prompt), `images` are the prepared images in order."""
    vis = vision_of(rt)
    prepared = vis.prepare(images)
    _, mm = vis.prompt(tokens, prepared, expand=False)
    return PromptImages(tokens, mm, keyed_rows(tokens, prepared, vis.ids.image))


def image_prompt(rt, prompt, images: list, live: bool) -> tuple[list[int], PromptImages]:
    """A prompt (text or ids) and its images as the engine's expanded ids and PromptImages: one
    image placeholder per image (<|image_pad|>, as the chat template writes it between
    <|vision_start|> and <|vision_end|>), or none, and then each image goes before the prompt.
    `live`: the stream goes on from a session's state (its images go in its messages)."""
    if not isinstance(images, (list, tuple)):
        raise TurboError(f"images of type {type(images).__name__}: expected a list of images (paths, bytes, "
                         "PIL images or data: URLs)")
    if live:
        raise TurboError("images go in a chat session's messages, not as images= of its stream")
    vis = vision_of(rt)
    ids = rt.encode(prompt)
    if vis.ids.image not in ids:
        ids = [vis.ids.vision_start, vis.ids.image, vis.ids.vision_end] * len(images) + ids
    prepared = vis.prepare(images)
    tokens = expand_placeholders(ids, [p.tokens(vis.config.merge) for p in prepared], vis.ids.image)
    return tokens, prompt_images(rt, tokens, prepared)


def message_images(messages: list) -> list:
    """The images of chat messages' content parts, in order: OpenAI's {"type": "image_url",
    "image_url": {"url": ...}} and {"type": "image", "image": ...} (a path, bytes, a PIL image or
    a data: URL), as Qwen's chat template renders each as one placeholder."""
    found = []
    for m in messages if isinstance(messages, (list, tuple)) else ():
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict):
                continue
            if part.get("type") == "image_url" or "image_url" in part:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if url is None:
                    raise TurboError('an image_url part without a url: expected {"image_url": {"url": "data:..."}}')
                found.append(url)
            elif part.get("type") == "image" or "image" in part:
                if part.get("image") is None:
                    raise TurboError('an image part without its image: expected {"type": "image", "image": PATH}')
                found.append(part["image"])
    return found


def check_placed(rt, ids: list[int], images: list) -> None:
    """The rendered prompt places every image (the chat template wrote one placeholder each)."""
    placed = ids.count(vision_of(rt).ids.image)
    if placed != len(images):
        raise TurboError(f"the chat template placed {placed} image placeholders for the messages' {len(images)} "
                         "images (does it render image content parts?)")


def refuse_unplaced(install: Install, ids: list[int], images: bool, live: bool) -> None:
    """A prompt holding image placeholders with no images behind them (`images` False: a chat
    session's turn with image parts, or raw <|image_pad|> ids) would embed the placeholder itself:
    refused. `live`: the prompt is a session's turn."""
    if images or not install.has_vision:
        return
    image = install.config.get("image_token_id")
    if isinstance(image, int) and image in ids:
        where = "a chat session's turn" if live else "the prompt"
        raise TurboError(f"{where} places an image (token {image}) with no image given: images go in "
                         "generate(images=) or in messages' image parts")

"""An install's vision side as the runtime uses it: the tower (tower.py), the processor's
settings (image.py), the multimodal token ids and rotary sections (config.py), and `prompt`,
which turns a token prompt with one placeholder per image into the trunk's rows and MmRows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TurboError
from ..install import Install
from .config import TokenIds, VisionConfig, mrope_section, token_ids, vision_config
from .image import ImageInput, ImageSpec, PreparedImage, prepare, spec_from_files
from .positions import MmRows, expand_placeholders, mm_rows
from .tower import TowerWeights, encode, tower_from_install


@dataclass
class Vision:
    config: VisionConfig
    weights: TowerWeights
    ids: TokenIds
    sections: tuple[int, int, int]
    rot_half: int
    spec: ImageSpec

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
        pixels = torch.cat([p.pixels for p in prepared]) if prepared else torch.empty(0, self.config.patch_dim)
        embeds = encode(self.config, self.weights, pixels, grids) if prepared else torch.empty(0, self.config.out_hidden)
        return tokens, mm_rows(tokens, grids, embeds, self.config.merge, self.ids.image, self.sections, self.rot_half)

"""Images in the TUI's chat (tui/chat.py): `/image PATH` typed in the box attaches an image to the
next message (an install with a vision tower, turbo/vision); the image is read and checked at
once (a refusal is the status line's), and the transcript shows each image where it sits in its
message, as `[image PATH]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text
from textual.widgets import Input, Static

from turbo.errors import TurboError
from turbo.vision.runtime import vision_of

from .view import visible

USER_STYLE = "bold #79c0ff"
IMAGE_STYLE = "italic #d2a8ff"


def user_turn(content: str | list, editing: bool) -> Static:
    """A user message as the transcript shows it: its text, and each image part as `[image NAME]`."""
    t = Text()
    t.append("you ", style=USER_STYLE)
    for part in content if isinstance(content, list) else [{"type": "text", "text": content or ""}]:
        if part.get("type") == "text":
            t.append(visible(part.get("text") or ""))
        else:
            t.append(f"[image {part.get('name') or 'attached'}]", style=IMAGE_STYLE)
            t.append(" ")
    return Static(t, classes="user-turn editing" if editing else "user-turn")


def text_of(content: str | list | None) -> str:
    """A message's text (an edit resends the text alone)."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if p.get("type") == "text")
    return content or ""


class ImageAttach:
    """Mixed into TurboApp with ChatMode: `attached` holds the image parts for the next message."""

    attached: list[dict[str, Any]]

    def attach_command(self, text: str) -> bool:
        """`/image PATH`: the image read, checked and attached (True: the text was the command)."""
        if not text.startswith("/image "):
            return False
        path = text[len("/image "):].strip()
        try:
            if self.runtime is None:
                raise TurboError("no install loaded")
            image = vision_of(self.runtime).prepare([Path(path).expanduser()])[0]
        except TurboError as e:
            self._set_status(f"/image: {e}", error=True)
            return True
        self.attached.append({"type": "image", "image": image, "name": path})
        self.query_one("#prompt", Input).value = ""
        names = ", ".join(p["name"] for p in self.attached)
        self._set_status(f"attached {names}: the next message takes {'them' if len(self.attached) > 1 else 'it'}")
        return True

    def take_content(self, text: str) -> str | list[dict[str, Any]]:
        """The next message's content: the attached images, then its text."""
        if not self.attached:
            return text
        parts, self.attached = self.attached + [{"type": "text", "text": text}], []
        return parts

"""Writing a repack's output (each file streamed by safetensors_format.write_safetensors):
`building(out)` gives the temporary sibling directory the install is written into, renamed to
`out` at the end and removed on any failure (`remove_stale_temporaries`: those of a killed repack)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import TurboError
from ..store import quant as q
from ..store.install import HEAD_COPY_KEY
from ..store.safetensors_format import Planned
from .tensors import FLOAT_ST

# A repack writes into the hidden sibling `.OUT.repack-PID-RANDOM` and renames it when done; the
# MARKER file inside says it is repack's own (only such a directory is ever removed as stale).
# Files repack writes itself get the umask's permissions (0644 under the usual 022); copied ones
# no more than their source's (copy_file).
TMP_MARK = ".repack-"
MARKER = ".turbo-repack"
TMP_PATTERN = re.compile(r"\..+\.repack-(\d+)-[0-9a-f]{8}")


def head_copy(planned: list[Planned], quantized: dict[str, dict], tied: bool, fmt: q.QFormat | None) -> dict[str, str]:
    """The __metadata__ that has a tied head read as a `fmt` copy of its float table at open
    (repack --float-quant: install.HEAD_COPY_KEY); nothing without one, or for a quantized table."""
    table = next((p for p in planned if p.name == "trunk.embed_tokens.weight"), None)
    if fmt is None or not tied or table is None or table.name in quantized or table.dtype not in FLOAT_ST:
        return {}
    return {HEAD_COPY_KEY: json.dumps({table.name: fmt.name})}


@contextmanager
def building(out: Path) -> Iterator[Path]:
    """A new temporary sibling of `out` to write the install into; renamed to `out` when the block
    ends, removed when it raises (an OSError becomes one TurboError line)."""
    for parent in (out.parent, *out.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise TurboError(f"{parent}: not a directory (expected one to write the install {out.name} into)")
            break
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out.parent)
        # os.mkdir applies the umask: the install gets an ordinary directory's permissions
        tmp = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        (tmp / MARKER).touch()
    except OSError as e:
        raise TurboError(f"{e.filename or out.parent}: cannot create the install there ({e.strerror})") from None
    try:
        yield tmp
        (tmp / MARKER).unlink()
        os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TurboError(f"{out}: cannot write the install ({e.strerror}{f': {e.filename}' if e.filename else ''})") \
            from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temporaries(parent: Path) -> None:
    """Remove what a repack killed outright (kill -9, power loss) left in `parent`: its temporary
    sibling is named after its pid, and a pid that no longer runs will not finish it. Anything
    else of that name (a link, a directory without repack's marker, one that cannot be removed)
    is left alone and does not stop this repack."""
    for path in parent.iterdir():
        m = TMP_PATTERN.fullmatch(path.name)
        if m is None or path.is_symlink() or not path.is_dir() or _running(int(m.group(1))):
            continue
        if not (path / MARKER).is_file() or (path / MARKER).is_symlink():
            continue
        try:
            shutil.rmtree(path)
        except OSError:
            continue
        print(f"removed {path}, left by an interrupted repack", file=sys.stderr)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def copy_file(src: Path, dst: Path) -> None:
    """A source file copied with no more permission bits than it has (a private file stays
    private) nor than the umask allows."""
    shutil.copyfile(src, dst)
    os.chmod(dst, stat.S_IMODE(dst.stat().st_mode) & stat.S_IMODE(src.stat().st_mode))

"""Save an SVG screenshot of a finished generation (the README's docs/tui.svg).

    python -m tui.screenshot [--out docs/tui.svg] [--size 110x32] [Hydra overrides]
    python -m tui.screenshot install.path=/path/to/install +policy=fixed block=4 max_new_tokens=96

Runs the app headless with the composed settings, submits the configured prompt (the workload's
first prompt unless prompt=... is given), waits for the end and writes the screen as SVG.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from .app import TurboApp
from .settings import compose_settings


async def _shoot(settings, out: Path, size: tuple[int, int], timing: bool) -> str:
    app = TurboApp(settings, timing=timing)
    async with app.run_test(size=size) as pilot:
        for _ in range(2):  # the load, then the generation
            while app.busy or any(w.is_running for w in app.workers):
                await pilot.pause(0.05)
            await app.workers.wait_for_complete()
            await pilot.pause()
            if app.runtime is None:
                raise SystemExit(f"error: {app.load_error}")
            if app.transcript is None:
                app.action_submit()
        if app.last_outcome != "done":
            raise SystemExit(f"error: {app.last_error}")
        app.query_one("#prompt").value = ""  # the prompt is already shown, dimmed, above the output
        await pilot.pause()
        out.parent.mkdir(parents=True, exist_ok=True)
        return app.save_screenshot(filename=out.name, path=str(out.parent))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out, size, timing, overrides = Path("docs/tui.svg"), (110, 32), True, []
    it = iter(argv)
    for a in it:
        if a == "--out":
            out = Path(next(it))
        elif a == "--size":
            w, h = next(it).lower().split("x")
            size = (int(w), int(h))
        elif a == "--no-timing":
            timing = False
        elif a in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            overrides.append(a)
    path = asyncio.run(_shoot(compose_settings(overrides), out, size, timing))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

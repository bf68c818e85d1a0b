"""python -m tui [Hydra overrides]: the interactive session.

Takes the overrides of `python -m turbo` (conf/config.yaml), e.g.
    python -m tui +policy=fixed block=4
    python -m tui install.path=/path/to/install workload=code rollback=replay
"""

from __future__ import annotations

import sys

from turbo import TurboError
from turbo.config import unknown_key
from turbo.extras import require

from .settings import compose_settings, conf_dir

USAGE = __doc__ + """
Keys: ⏎ submit · esc stop · ctrl+n policy/block (off, auto, fixed 1..8) · ctrl+r rollback ·
      ctrl+o workload presets · ctrl+l clear · ctrl+q quit.  Type /open PATH to open another install.
Chat (an install with a chat template, or chat_template=PATH, or type /template PATH):
      ⏎ sends · ctrl+y retry the last turn · ctrl+p edit an earlier message (again: an earlier one;
      ⏎ resends, esc cancels) · ctrl+l new chat · ctrl+b reasoning open/closed · ctrl+g chat ⇄ raw.
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        require("textual", "tui")  # before .app, which is built on it
        problem = unknown_key(conf_dir(), argv)
        if problem:
            raise TurboError(problem)
        settings = compose_settings(argv)
    except TurboError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # Hydra's override / composition errors: one line, no traceback
        print(f"error: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
              file=sys.stderr)
        return 2
    from .app import TurboApp  # after require(): textual is the tui extra

    TurboApp(settings).run()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C while it loads (in the app, ctrl+c is a key: it stops a generation)
        print("interrupted", file=sys.stderr)
        sys.exit(130)

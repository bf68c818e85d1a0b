"""python -m turbo.repack SRC OUT ...: the repack's command line (turbo/repack/__init__.py, `main`)."""

import sys

from . import main

sys.exit(main())

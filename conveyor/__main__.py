"""``python -m conveyor``: the ``conveyor`` command (``conveyor.cli.main``), for a Python whose scripts
directory is not on PATH; ``--capture-video-every`` starts ``python -m conveyor enjoy`` with it."""

import sys

from conveyor.cli import main

sys.exit(main())

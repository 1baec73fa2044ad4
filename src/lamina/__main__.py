"""``python -m lamina``: the ``lamina`` command line (lamina.cli.main)."""

import sys

from lamina.cli.main import main

sys.exit(main())

"""``python -m jquant ...``: the ``jquant`` command, for source trees that are not installed."""

import sys

from jquant.apps.cli import main

sys.exit(main())

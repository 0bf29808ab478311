"""``python -m ztunnel``: the same as the ``ztunnel`` command."""

import sys

from ztunnel.cli import main

sys.exit(main())

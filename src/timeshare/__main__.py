"""``python -m timeshare``: the command line."""

import sys

from timeshare.cli import main

sys.exit(main())

"""``python -m kvdepot ...`` is the ``kvdepot`` command."""

import sys

from kvdepot.cli import main

sys.exit(main())

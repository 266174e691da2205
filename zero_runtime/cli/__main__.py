"""``python -m zero_runtime.cli``: the ``zero-runtime`` command line."""

import sys

from zero_runtime.cli import main

sys.exit(main())

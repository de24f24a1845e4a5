"""``python -m attnkit.bench``: the same as ``attnkit bench``."""

import sys

from attnkit.bench.command import main

sys.exit(main())

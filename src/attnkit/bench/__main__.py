"""``python -m attnkit.bench``: the same as ``attnkit bench``."""

import sys

from attnkit.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))

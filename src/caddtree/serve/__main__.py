"""``python -m caddtree.serve [options]``: the same as ``caddtree serve``."""

import sys

from . import main

sys.exit(main())

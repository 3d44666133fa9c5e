"""``python -m caddtree.cli ...`` (and ``torchrun -m caddtree.cli bench ...``): the ``caddtree``
command."""

import sys

from . import main

sys.exit(main())

"""``python -m transmuter_jax``: the transmuter-jax command line."""

import sys

from .cli import main

sys.exit(main())

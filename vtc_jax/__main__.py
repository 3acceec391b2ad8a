"""``python -m vtc_jax ...`` — same as the ``vtc-jax`` console script."""
import sys

from vtc_jax.cli import main

sys.exit(main())

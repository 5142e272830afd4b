"""``python -m memlab``: the same command line as ``memlab`` (memlab.cli)."""
import sys

from memlab.cli import main

sys.exit(main())

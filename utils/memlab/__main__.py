"""``python -m memlab``: the same command line as ``memlab`` (memlab.cli)."""
from memlab.cli import console

console()

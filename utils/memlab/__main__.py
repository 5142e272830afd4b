import sys

from memlab.cli import main

sys.exit(main())

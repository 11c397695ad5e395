"""`python -m bridge ...` and `torchrun -m bridge train ...` enter here."""

import sys

from bridge.cli import main

sys.exit(main())

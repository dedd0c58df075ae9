"""`python -m kvedge …`: the same command line as the `kvedge` script (kvedge.cli)."""

import sys

from kvedge.cli import main

sys.exit(main())

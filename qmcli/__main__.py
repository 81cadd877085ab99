"""`python -m qmcli`: the same as the installed `qm` script."""

import sys

from qmcli.cli import main

sys.exit(main())

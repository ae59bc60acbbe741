"""`python -m kvconnector ...`: the `kvconnector` command without its console script."""

import sys

from kvconnector.cli import main

sys.exit(main())

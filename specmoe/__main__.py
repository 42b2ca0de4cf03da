"""`python3 -m specmoe` is the `specmoe` command."""

import sys

from specmoe.cli import main

sys.exit(main())

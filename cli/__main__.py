"""`python -m eyas.cli COMMAND ...`: the `eyas` command."""
import sys

from eyas.cli.main import main

sys.exit(main())

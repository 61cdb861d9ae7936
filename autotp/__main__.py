"""``python -m autotp``: the same command line as the ``autotp`` script."""

import sys

from autotp.cli import main

# The guard matters: multiprocessing's spawn start method re-imports the parent's __main__ in
# every child (``autotp verify --procs``), which must not run the command again.
if __name__ == "__main__":
    sys.exit(main())

"""`python -m executor`: run one executor service (flags: `python -m executor --help`)."""

from __future__ import annotations

import sys

from executor.service import main

if __name__ == "__main__":
    sys.exit(main())

"""The scratch folder a benchmark writes its model into, removed however the run ends.

A benchmark model is hundreds of MB. `tempfile.TemporaryDirectory` removes its folder
when the `with` block ends by return or exception, but SIGTERM (what `timeout` and a
job runner send) ends the process without leaving the block, and the folder stays.
`scratch_folder` turns SIGTERM into SystemExit for the length of the block, and holds a
SIGTERM that comes while the folder is being removed until the removal is done, so the
folder goes in every ending but SIGKILL.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


@contextmanager
def scratch_folder(prefix: str = "kvgate-bench-") -> Iterator[Path]:
    """A new empty folder, removed with its contents when the block ends or on SIGTERM."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    finally:
        held: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum))
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            signal.signal(signal.SIGTERM, previous)
        if held:
            sys.exit(128 + signal.SIGTERM)

"""``progress=``: a caller's callable, or one tqdm bar on stderr."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from ._sources import NAME


class Bar:
    """``progress=True``: one tqdm bar on stderr for the whole load (bytes,
    MB/s, ETA), made at the first report, when the total is known."""

    def __init__(self, tqdm: Any) -> None:
        self.tqdm = tqdm
        self.bar: Any = None
        self.shown = 0
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            if self.bar is None:
                self.bar = self.tqdm(
                    total=total,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1000,
                    desc=NAME,
                    file=sys.stderr,
                    leave=True,
                )
            if done > self.shown:
                self.bar.update(done - self.shown)
                self.shown = done
            if done >= total:
                self.bar.close()


def progress_callback(progress: Any) -> Callable[[int, int], None] | None:
    if progress is False or progress is None:
        return None
    if progress is True:
        try:
            from tqdm import tqdm  # optional: imported only when asked for
        except ImportError:
            return None
        return Bar(tqdm)
    if callable(progress):
        return progress
    raise TypeError(
        f"{NAME}: progress must be True, False or a callable (bytes_done, bytes_total), "
        f"got {type(progress).__name__}"
    )

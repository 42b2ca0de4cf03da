"""Progress bars of the long loops (calibration, sampling, decoding the workload, replay): tqdm on stderr, shown
only where it is a terminal and the command was not given --no-progress; the bars of one step vanish when it
ends (the run's bar over cells stays)."""

from __future__ import annotations

import sys


def bar(total: int, desc: str, enabled: bool = True, unit: str = "it", leave: bool = False):
    """A tqdm bar of `total` steps (a no-op bar where not `enabled` or stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled or not sys.stderr.isatty(), file=sys.stderr,
                leave=leave, dynamic_ncols=True)


def each(items, desc: str, enabled: bool = True, unit: str = "it"):
    """Iterate over `items` (a sized collection) with a `bar`."""
    with bar(len(items), desc, enabled, unit) as b:
        for item in items:
            yield item
            b.update(1)

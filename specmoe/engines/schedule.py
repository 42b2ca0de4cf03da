"""An engine run's copies per token and layer, for its schedule floor (`specmoe.routing.schedule.schedule_floor`,
re-exported here): the run's own routing replayed through its policy's `LogicalCache` and checked against the
copies the run counted."""

from __future__ import annotations

import numpy as np

from specmoe.routing.replay import replay
from specmoe.routing.schedule import schedule_floor

from .results import COPY_FIELDS

__all__ = ["policy_copies", "schedule_floor"]


def policy_copies(engine, result, feed=None) -> tuple[np.ndarray, np.ndarray]:
    """The demand copies and prefetch insertions [T, L] of each timed position of an autoregressive `result` of
    `engine` (a teacher-forced window or a followed trace; `feed`: the `LogitFeed` it followed, None for the
    model's own router), by replaying the logits it routed on through its policy's `LogicalCache` from the warm
    set (`specmoe.routing.replay`, the code the engines run). Raises ValueError where the replay's per-token
    counts differ from those the run counted (then the run did not start from the warm set, or its routing did
    not follow the recorded logits)."""
    router = engine.router
    if result.k != 0 or result.router_logits is None or router is None or not hasattr(router, "feed_rule"):
        raise ValueError("policy_copies needs an autoregressive run of a cache policy with its routing recorded")
    pregate = result.pregate_logits.astype(np.float64) if router.policy.insert_budget else None
    replayed = replay(router.policy, result.router_logits.astype(np.float64), pregate, result.input_tokens,
                      router.calibration, scoring=router.feed_rule(feed))
    timed = np.flatnonzero(result.timed)
    demand, prefetch = replayed.demand_copies[timed], replayed.prefetch_copies[timed]
    counted = result.copies[timed]
    for name, mine in (("demand", demand), ("prefetch", prefetch)):
        theirs = counted[:, COPY_FIELDS.index(name)]
        if not np.array_equal(mine.sum(axis=1), theirs):
            bad = int(np.flatnonzero(mine.sum(axis=1) != theirs)[0])
            raise ValueError(f"the replay's {name} copies differ from the run's at timed token {bad} "
                             f"({int(mine[bad].sum())} against {int(theirs[bad])})")
    return demand, prefetch

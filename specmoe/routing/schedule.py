"""The schedule floor of an autoregressive run: the time per token that the policy's copies leave at best, given
when the policy decides them, the link's copy time and the all-resident compute.

`max(all-resident ms, copies x copy ms)` bounds a token only when copies can overlap any compute. They cannot:
a demand copy of layer l is decided by layer l's route, right before the MoE that needs it, so none of it
overlaps compute; a prefetch for layer l is decided at layer l - 1 (part 1 on the pre-gate), so it overlaps at
most one layer's compute. On a trace with few copies per token (a trained model's routing) that, not the link,
is what an offloaded token pays, and no engine can do better without changing the policy's decisions.

The model behind `schedule_floor` (a floor for engines that issue each copy when the policy decides it):
- the token's compute is the all-resident token's, `layer_ms` per layer, and waits only at each layer's MoE,
  which needs that layer's copies of the token;
- compute reaches layer l's MoE (its "gate") `layer_ms` after it left layer l - 1's; the demand copies of layer
  l are released there, the prefetches for layer l at layer l - 1's gate (one layer ahead);
- one link moves copies one after another, `copy_ms` each, always the earliest layer's released copy first
  (preempting a later layer's): so each gate waits the least any order of copies allows;
- every prefetch the policy inserts is moved (the device policy's rule; the host policy may drop a prefetch
  evicted before it was issued), and each is due at its layer of the token that inserted it.
A policy's per-layer copies come from `specmoe.routing.replay` (`ReplayResult.demand_copies`, `prefetch_copies`;
`replay_policies(..., floor=...)` prices them here) or, for an engine's run, `specmoe.engines.schedule.policy_copies`.
No torch here.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def schedule_floor(demand: np.ndarray, prefetch: np.ndarray, layer_ms: float, copy_ms: float) -> np.ndarray:
    """ms per token [T] of T consecutive tokens under the model above. demand, prefetch: int [T, L], the demand
    copies of each token and layer, and the prefetches for each token and layer (decided one layer ahead; those
    for layer 0 are released at layer 0's gate, as there is no layer before it). The floor is the token's compute
    (L x layer_ms) plus the waits at its gates."""
    demand = np.asarray(demand, dtype=np.int64)
    prefetch = np.asarray(prefetch, dtype=np.int64)
    if demand.ndim != 2 or demand.shape != prefetch.shape:
        raise ValueError(f"demand and prefetch must both be [T, L], got {demand.shape} and {prefetch.shape}")
    if (demand < 0).any() or (prefetch < 0).any():
        raise ValueError("copy counts must be non-negative")
    if not (layer_ms >= 0 and copy_ms >= 0):
        raise ValueError(f"layer_ms and copy_ms must be non-negative, got {layer_ms} and {copy_ms}")
    floor = np.empty(demand.shape[0])
    _floor(demand, prefetch, float(layer_ms), float(copy_ms), floor)
    return floor


@njit(cache=True)
def _floor(demand, prefetch, layer_ms, copy_ms, floor):
    """`schedule_floor`'s schedule, token by token, into floor [T] (numba: a map replays thousands of tokens)."""
    num_tokens, num_layers = demand.shape
    # The link's state: the time up to which it has worked (link_at), and the work in ms released for the layer
    # compute reaches next (ahead), the only later layer with work at any time (prefetches go one layer ahead).
    link_at = 0.0
    now = 0.0  # compute's clock
    for t in range(num_tokens):
        start = now
        ahead = prefetch[t, 0] * copy_ms  # layer 0's prefetches: released at its gate (no layer before it)
        for layer in range(num_layers):
            arrive = now if layer == 0 else now + layer_ms
            # until compute arrives, the link works on this layer's prefetches, released one layer ago
            pending = ahead
            link_at = max(link_at, now)
            pending -= min(pending, arrive - link_at)
            # at the gate: this layer's demand copies join the rest of its prefetches and go first (the link
            # is busy up to `arrive` where prefetches are left); the next layer's prefetches, released now, wait
            pending += demand[t, layer] * copy_ms
            gate = arrive + pending
            link_at = gate if pending > 0 else max(link_at, arrive)
            ahead = prefetch[t, layer + 1] * copy_ms if layer + 1 < num_layers else 0.0
            now = gate
        now += layer_ms  # the last layer's MoE and the head
        floor[t] = now - start

"""The largest sizes any entry point takes (commands, configs, `SpeculativeConfig`, `AcceptanceProfile`,
`PolicyConfig`).

A size beyond these can mean nothing the project runs, so it is refused before any work rather than left to hang
or to run past the model's positions; sizes within them are also checked against the model where one is known.
This module imports nothing, so that the command line's parsers can state the maxima.
"""

MAX_DRAFTS = 1024  # k, drafts per verification block
MAX_TOKENS = 1 << 20  # tokens of a prompt or window, new tokens per request, a static cache's positions
MAX_COUNT = 100_000  # prompts, windows, calibration windows
MAX_ROUNDS = 1000  # rounds of a run
MAX_CELLS = 100_000  # configurations of a run's grid, times its rounds
MAX_THREADS = 1024  # torch CPU threads
MAX_EXPERTS = 1 << 16  # experts per layer: a policy's capacity, K, insertions and pre-gate window

"""The default sweeps of `specmoe replay-sd` (a module of its own, without imports, so that the command line's
parser shows them without loading the replay)."""

LAMBDAS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)  # the rollback cache's bonus lambda
BUDGETS = (1, 2)  # its insertion budgets n
GAMMAS = (0.5, 1.0, 1.25, 1.5, 1.75, 2.0, 3.0)  # block selection's gamma
PRUNE_BUDGETS = (0.0, 1.0)  # its prune budgets
SELECTORS = ("acceptmoe", "confidence_top1")  # the block selectors besides exact

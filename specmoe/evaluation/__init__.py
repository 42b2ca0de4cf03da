"""Benchmark evaluation: an lm-evaluation-harness model that runs a transformers MoE model under a routing
policy or speculative decoding in the harness (`lm_eval_model`, needs the `eval` extra), and `specmoe compare`,
the paired per-question comparison of two runs' logged samples (`compare`, no lm-eval needed).

Nothing is imported here, so `import specmoe.evaluation` works without lm-eval installed."""

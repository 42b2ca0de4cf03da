"""Training and measurement of the small model family shipped in specmoe/assets/family.

corpus (offline text split by file), tokenizer (byte-level BPE), configs (sizes and presets), train (target
with OLMoE's load-balancing loss, AR and DFlash drafters against the frozen target), evaluate (perplexity,
tau, routing locality), family (the whole pipeline), replay_metrics (copies per token of the paper's policies).
The command is scripts/train_family.py.
"""

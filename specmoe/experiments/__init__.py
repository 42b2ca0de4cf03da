"""Experiment commands: the main job (`demo`), `calibrate`, and speculative decoding (`sd`)."""

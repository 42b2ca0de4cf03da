"""Experiment commands: the main job (`demo`) and `calibrate`."""

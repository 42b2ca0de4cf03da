"""Decoding engines built on specmoe.offload: the autoregressive engine (`ar`); the speculative one follows.
Both receive an `ExpertResidency` unit and a `Decoder`, and launch its steps through a `StepRunner`."""

from .ar import ArEngine, EngineConfig, RunSettings, build_engine, build_engine_from_checkpoint
from .results import DecodeResult, LogitFeed

__all__ = ["ArEngine", "DecodeResult", "EngineConfig", "LogitFeed", "RunSettings", "build_engine",
           "build_engine_from_checkpoint"]

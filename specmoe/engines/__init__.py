"""Decoding engines built on specmoe.offload: the autoregressive engine (`ar`); the speculative one follows."""

from .ar import ArEngine, EngineConfig, build_engine, build_engine_from_checkpoint
from .results import DecodeResult, Trace

__all__ = ["ArEngine", "DecodeResult", "EngineConfig", "Trace", "build_engine", "build_engine_from_checkpoint"]

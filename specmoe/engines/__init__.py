"""The offloading engine (`Engine`): autoregressive and speculative decoding through one decode loop, with a
router behind a small protocol (`routers`: the logical-cache router of the autoregressive policies, the block
router of speculative decoding). It receives an `ExpertResidency` unit and a `Decoder`, and launches the
decoder's steps through a `StepRunner` per static number of positions. Speculative decoding is configured
with `specmoe.speculation.SpeculativeConfig`."""

from .config import EngineConfig, RunSettings
from .build import build_engine, build_engine_from_checkpoint
from .engine import Engine
from .results import DecodeResult, LogitFeed
from .routers import BlockRouter, CacheRouter, Router

__all__ = ["BlockRouter", "CacheRouter", "DecodeResult", "Engine", "EngineConfig", "LogitFeed", "Router",
           "RunSettings", "build_engine", "build_engine_from_checkpoint"]

"""Inference engines: the :class:`InferenceEngine` protocol and its implementations.

Importing this package registers the built-in engines (``fake``); it imports no jax.
"""

from asyncrl.engine.fake import FakeEngine
from asyncrl.engine.protocol import STOP_REASONS, GenerationRequest, GenerationResponse, InferenceEngine, StopReason

__all__ = ["InferenceEngine", "GenerationRequest", "GenerationResponse", "StopReason", "STOP_REASONS", "FakeEngine"]

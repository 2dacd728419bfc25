"""Inference engines: the :class:`InferenceEngine` protocol and its implementations.

Importing this package registers ``fake`` and imports no jax; ``jax`` (:class:`~asyncrl.engine.jax_engine.JaxEngine`)
registers when ``asyncrl.engine.jax_engine`` is imported (the registry does so on the first engine resolve).
"""

from asyncrl.engine.fake import FakeEngine
from asyncrl.engine.protocol import STOP_REASONS, GenerationRequest, GenerationResponse, InferenceEngine, StopReason

__all__ = ["InferenceEngine", "GenerationRequest", "GenerationResponse", "StopReason", "STOP_REASONS", "FakeEngine"]

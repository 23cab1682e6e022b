"""Kev's engine: many isolated questions, one packed forward per step. Imports no Kafka, no asyncio."""

from engine.adapters.files import AdapterError, LoraAdapter
from engine.core import EngineCore
from engine.engine import Engine
from engine.rejection import QuestionRejected
from engine.model.model import Model, load_model
from engine.options import EngineOptions
from engine.output.handle import Handle
from engine.output.processor import StepEvents, TokenDelta
from engine.pipeline import Answer, IsolatedBatchPipeline

__all__ = ["AdapterError", "Answer", "Engine", "Handle", "EngineCore", "EngineOptions", "IsolatedBatchPipeline",
           "LoraAdapter", "Model", "QuestionRejected", "StepEvents", "TokenDelta", "load_model"]

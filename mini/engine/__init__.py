"""Continuous-batching engine: sequences, scheduler, block manager, model runner, sampler, LLM / async engine."""
from mini.engine.llm import LLM, EngineOptions, LLMEngine, RequestOutput, build_engine
from mini.engine.sequence import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineOptions", "RequestOutput", "SamplingParams", "build_engine"]

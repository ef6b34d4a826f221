"""The model composed from ops: weights, cache pools, the flat Batch and the forward step."""
from mini.model.batch import Batch, DecodeBuffers, EngramInput, SeqChunk
from mini.model.cache import KVCache
from mini.model.load import load_model
from mini.model.model import Model

__all__ = ["Batch", "DecodeBuffers", "EngramInput", "KVCache", "Model", "SeqChunk", "load_model"]

"""Checkpoint I/O: the tensor inventory of a config, strict lazy loading of sharded safetensors (EP subsets),
and random checkpoints in the official layout."""
from mini.checkpoint.inventory import (TensorSpec, Weight, expected_tensors, expert_index, expert_range,
                                       skip_reason, weights)
from mini.checkpoint.load import CheckpointError, iter_state, load_state
from mini.checkpoint.make import make_checkpoint, random_state

__all__ = ["CheckpointError", "TensorSpec", "Weight", "expected_tensors", "expert_index", "expert_range",
           "iter_state", "load_state", "make_checkpoint", "random_state", "skip_reason", "weights"]

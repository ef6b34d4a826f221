"""Checkpoint I/O: the tensor inventory of a config, strict lazy loading of sharded safetensors (EP subsets),
and random checkpoints in the official layout."""
from mini.checkpoint.inventory import TensorSpec, Weight, expected_tensors, expert_index, expert_range, skip_reason

__all__ = ["TensorSpec", "Weight", "expected_tensors", "expert_index", "expert_range", "skip_reason"]

"""`load_model`: a checkpoint directory (or a preset name) -> (Model, ModelConfig, Tokenizer).

A preset name stands for a random checkpoint of that preset, written once to `<cache>/<preset>-seed0` (the cache:
MINI_CACHE, default ~/.cache/mini; made in a temporary directory and renamed into place, so concurrent first calls
do not see half a checkpoint).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from mini import switches
from mini.config import PRESETS, ModelConfig
from mini.model.model import ENGRAM_DEVICE_BYTES, Model

CACHE_DIR: Path | None = None  # where preset checkpoints go (tests set it); None: MINI_CACHE (mini.switches)


def cache_dir() -> Path:
    """Where preset checkpoints are written: CACHE_DIR, else MINI_CACHE, else ~/.cache/mini."""
    return CACHE_DIR if CACHE_DIR is not None else switches.current().cache_dir


def preset_checkpoint(name: str, seed: int = 0) -> Path:
    """The directory of the random checkpoint of preset `name`, made on first use."""
    from mini.checkpoint.make import make_checkpoint
    out = cache_dir() / f"{name}-seed{seed}"
    if not (out / "config.json").exists():
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        make_checkpoint(name, tmp, seed)
        try:
            tmp.rename(out)
        except OSError:  # another process won the race: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_model(path_or_preset: str | Path, device="cpu", dtype=torch.bfloat16, experts: range | None = None,
               engram_device_bytes: int = ENGRAM_DEVICE_BYTES, progress: bool | None = None):
    """(Model, ModelConfig, Tokenizer). `experts` keeps only those routed experts (an EP rank). The model's
    `hasher` (Engram hash ids for Batch.build) is set when the model has Engram layers; its Engram tables go to
    `device` when they fit in `engram_device_bytes` (see Model). `progress`: a loading bar (None: on a terminal)."""
    from mini.checkpoint.load import load_state
    from mini.tokenizer import Tokenizer, load_token_map
    path = str(path_or_preset)
    root = preset_checkpoint(path) if path in PRESETS and not Path(path).exists() else Path(path)
    config = ModelConfig.load(root)
    model = Model(config, load_state(root, config, experts, progress=progress), device, dtype, experts=experts,
                  consume_state=True, engram_device_bytes=engram_device_bytes)
    if config.engram_layer_ids:
        from mini.ops.engram import EngramHasher
        model.hasher = EngramHasher(config, load_token_map(root))
    return model, config, Tokenizer.from_dir(root)

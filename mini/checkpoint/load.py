"""Strict, lazy loading of a sharded safetensors checkpoint (spec §4.1).

Tensors come from `safetensors.safe_open`, which memory-maps each shard: a returned CPU tensor is a view of the
file's pages and reading it costs page cache, not process memory. With `device=` each tensor is copied to that
device as its shard is read and the shard's map is released before the next one, so host memory peaks at about
one shard. Routed experts outside `experts` are never read, and shards that hold only such experts are never
opened (EP rank r of n reads 1/n of the expert bytes).

Every problem is an error that names the tensor and the file: missing shard file, tensor missing from the index
or from its shard, unexpected tensor, wrong dtype or shape, truncated/corrupt file, a NaN scale (E8M0 byte 255),
a non-finite bf16/fp32 value, or a V4 hash-routing table (`tid2eid`) pointing outside the experts.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from mini.checkpoint.inventory import TensorSpec, expected_tensors, skip_reason
from mini.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
log = logging.getLogger("mini.checkpoint")
_CHECK_CHUNK = 1 << 20  # elements per value-check step


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor and the file."""


def load_state(path: str | Path, config: ModelConfig | None = None, experts: range | None = None,
               progress: bool = True, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """name -> tensor for every tensor of `config` (read from `path`/config.json when None), routed experts
    limited to `experts`. CPU tensors stay memory-mapped; `device` copies them there shard by shard."""
    return dict(iter_state(path, config, experts, progress, device))


def iter_state(path: str | Path, config: ModelConfig | None = None, experts: range | None = None,
               progress: bool = True, device: str | torch.device | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """`load_state` as a stream of (name, tensor), one shard after another."""
    root = Path(path)
    config = config or ModelConfig.load(root)
    index_name, weight_map = _weight_map(root)
    full = expected_tensors(config)
    for name in full:
        if name not in weight_map:
            raise CheckpointError(f"tensor {name} is missing: {index_name} does not list it")
    skipped = Counter()
    for name, file in weight_map.items():
        if name not in full:
            reason = skip_reason(name, config)
            if reason is None:
                raise CheckpointError(f"unexpected tensor {name} in {file}: not part of the {config.version} "
                                      f"model described by config.json")
            skipped[reason] += 1
    if skipped:
        log.info("checkpoint %s: skipped %s", root, ", ".join(f"{n} {r} tensors" for r, n in skipped.items()))

    wanted = full if experts is None else expected_tensors(config, experts)
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(weight_map[name], []).append(name)
    listed: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        listed.setdefault(file, set()).add(name)
    total = sum(s.nbytes for s in wanted.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {root.name}",
              disable=None if progress is None else not progress) as bar:
        for file in sorted(by_file):
            for name, tensor in _read_shard(root / file, by_file[file], listed[file], wanted, config, device):
                bar.update(wanted[name].nbytes)
                yield name, tensor


def _weight_map(root: Path) -> tuple[str, dict[str, str]]:
    """(file the map came from, tensor name -> shard file name)."""
    index = root / INDEX_FILE
    if index.exists():
        try:
            return INDEX_FILE, dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{index} is corrupt: {e!r}") from None
    single = root / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"no checkpoint in {root}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")
    try:
        with safe_open(single, "pt") as f:
            return SINGLE_FILE, {name: SINGLE_FILE for name in f.keys()}
    except SafetensorError as e:
        raise CheckpointError(f"{single} is truncated or corrupt: {e}") from None


def _read_shard(file: Path, names: list[str], listed: set[str], specs: dict[str, TensorSpec],
                config: ModelConfig, device) -> Iterator[tuple[str, torch.Tensor]]:
    if not file.exists():
        raise CheckpointError(f"shard file {file} is missing; it holds {names[0]}"
                              + (f" and {len(names) - 1} more tensors" if len(names) > 1 else ""))
    try:
        handle = safe_open(file, "pt")
    except SafetensorError as e:
        raise CheckpointError(f"shard {file} (holding {names[0]} …) is truncated or corrupt: {e}") from None
    with handle as f:
        present = set(f.keys())
        extra = sorted(present - listed)
        if extra:
            raise CheckpointError(f"unexpected tensor {extra[0]} in {file}: the index does not map it to this file")
        for name in names:
            if name not in present:
                raise CheckpointError(f"tensor {name} is missing from {file} (the index maps it there)")
            t = f.get_tensor(name)
            spec = specs[name]
            if t.dtype != spec.dtype:
                raise CheckpointError(f"tensor {name} in {file} has dtype {t.dtype}, expected {spec.dtype}")
            if tuple(t.shape) != spec.shape:
                raise CheckpointError(f"tensor {name} in {file} has shape {list(t.shape)}, expected {list(spec.shape)}")
            if device is not None:
                t = t.to(device)
            _check_values(name, file, t, config)
            yield name, t


def _check_values(name: str, file: Path, t: torch.Tensor, config: ModelConfig) -> None:
    if t.dtype == torch.float8_e8m0fnu:
        what, test = "NaN scale (E8M0 byte 255)", lambda x: x.view(torch.uint8) == 255
    elif t.dtype in (torch.bfloat16, torch.float32):  # exponent bits all ones: inf or NaN
        bits, exp = (torch.int16, 0x7F80) if t.dtype == torch.bfloat16 else (torch.int32, 0x7F800000)
        what, test = "non-finite value", lambda x: (x.view(bits) & exp) == exp
    elif t.dtype == torch.int64:  # V4 tid2eid
        n = config.n_routed_experts
        what, test = f"expert id outside [0, {n})", lambda x: (x < 0) | (x >= n)
    else:  # fp8 / packed fp4 payloads: every byte pattern is checked through its scale only
        return
    # in chunks, so the check's scratch stays small next to a shard
    parts = t.reshape(-1).split(_CHECK_CHUNK)
    flags = [test(p).any() for p in parts]
    if flags and bool(torch.stack(flags).any()):
        k = next(i for i, f in enumerate(flags) if bool(f))
        flat = k * _CHECK_CHUNK + int(test(parts[k]).nonzero()[0, 0])
        where = [int(i) for i in torch.unravel_index(torch.tensor(flat), t.shape)]
        raise CheckpointError(f"{what} in tensor {name} at index {where} ({file})")

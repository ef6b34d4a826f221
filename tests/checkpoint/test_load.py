"""load_state: round trips, every error path (each error names the tensor and the file), skipped tensors, EP
subsets that never read the other experts, and peak host memory of about one shard."""
import json
import logging
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mini.checkpoint.load as load_mod
from mini.checkpoint import CheckpointError, expected_tensors, expert_index, load_state, make_checkpoint, random_state
from mini.config import preset

INDEX = "model.safetensors.index.json"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(_bytes(a[k]), _bytes(b[k])), k


@pytest.fixture(scope="module")
def tiny41(tmp_path_factory):
    return make_checkpoint("tiny-v4.1", tmp_path_factory.mktemp("ck") / "tiny-v4.1", seed=3, shard_bytes=300_000)


@pytest.fixture
def copy41(tiny41, tmp_path):
    """A private copy of the tiny V4.1 checkpoint to corrupt."""
    return Path(shutil.copytree(tiny41, tmp_path / "ck"))


def _index(ck: Path) -> dict:
    return json.loads((ck / INDEX).read_text())


def _write_index(ck: Path, index: dict):
    (ck / INDEX).write_text(json.dumps(index))


def _shard_of(ck: Path, name: str) -> Path:
    return ck / _index(ck)["weight_map"][name]


def _rewrite(ck: Path, name: str, fn):
    """Replace tensor `name` in its shard by fn(tensor) (fn returns None to drop it)."""
    shard = _shard_of(ck, name)
    tensors = load_file(shard)
    new = fn(tensors.pop(name).clone())
    if new is not None:
        tensors[name] = new
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def _load_error(ck: Path, **kw) -> str:
    with pytest.raises(CheckpointError) as e:
        load_state(ck, progress=False, **kw)
    return str(e.value)


@pytest.mark.parametrize("name", ["tiny-v4.1", "tiny-v4"])
def test_round_trip_equals_generated_state(name, tmp_path):
    cfg = preset(name)
    ck = make_checkpoint(name, tmp_path / name, seed=11, shard_bytes=250_000)
    assert len(list(ck.glob("model-*-of-*.safetensors"))) >= 3
    state = load_state(ck, progress=False)
    specs = expected_tensors(cfg)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in state.items()} == {n: (s.dtype, s.shape) for n, s in specs.items()}
    _assert_same(state, random_state(cfg, seed=11))
    assert _index(ck)["metadata"]["total_size"] == sum(s.nbytes for s in specs.values())


def test_single_file_checkpoint(tiny41, tmp_path):
    ck = tmp_path / "single"
    ck.mkdir()
    shutil.copy(tiny41 / "config.json", ck)
    state = load_state(tiny41, progress=False)
    save_file({k: v.contiguous() for k, v in state.items()}, ck / "model.safetensors", metadata={"format": "pt"})
    _assert_same(load_state(ck, progress=False), state)


def test_missing_shard_file(copy41):
    name = "layers.3.attn.wq_b.weight"
    shard = _shard_of(copy41, name)
    shard.unlink()
    msg = _load_error(copy41)
    assert shard.name in msg and "missing" in msg and "layers." in msg


def test_tensor_missing_from_index(copy41):
    index = _index(copy41)
    del index["weight_map"]["layers.5.ffn.shared_experts.w2.scale"]
    _write_index(copy41, index)
    msg = _load_error(copy41)
    assert "layers.5.ffn.shared_experts.w2.scale" in msg and INDEX in msg and "missing" in msg


def test_tensor_missing_from_its_shard(copy41):
    name = "layers.6.attn.indexer.weights_proj.weight"
    shard = _rewrite(copy41, name, lambda t: None)
    msg = _load_error(copy41)
    assert name in msg and shard.name in msg and "missing" in msg


def test_unexpected_tensor(copy41):
    name, extra = "layers.0.attn.wkv.weight", "layers.0.attn.wkv.bias"
    shard = _shard_of(copy41, name)
    tensors = load_file(shard)
    tensors[extra] = torch.zeros(64, dtype=torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    msg = _load_error(copy41)  # in the shard but not in the index
    assert extra in msg and shard.name in msg and "unexpected" in msg
    index = _index(copy41)
    index["weight_map"][extra] = shard.name
    _write_index(copy41, index)
    msg = _load_error(copy41)  # in both: still not a tensor of the model
    assert extra in msg and shard.name in msg and "unexpected" in msg


def test_wrong_dtype(copy41):
    name = "layers.2.attn.compressor.wgate.weight"
    shard = _rewrite(copy41, name, lambda t: t.float())
    msg = _load_error(copy41)
    assert name in msg and shard.name in msg and "dtype" in msg and "float32" in msg


def test_wrong_shape(copy41):
    name = "layers.4.ffn.experts.9.w2.scale"  # MXFP4 scale [dim, inter/32] = [64, 2]
    shard = _rewrite(copy41, name, lambda t: t[:, :1].contiguous())
    msg = _load_error(copy41)
    assert name in msg and shard.name in msg and "shape" in msg and "[64, 2]" in msg


@pytest.mark.parametrize("damage", ["truncated", "garbage header", "empty"])
def test_corrupt_shard(copy41, damage):
    shard = _shard_of(copy41, "head.weight")
    data = shard.read_bytes()
    shard.write_bytes({"truncated": data[: len(data) - 1000], "garbage header": b"\xff" * 64 + data[64:],
                       "empty": b""}[damage])
    msg = _load_error(copy41)
    held = [n for n, f in _index(copy41)["weight_map"].items() if f == shard.name]
    assert shard.name in msg and "corrupt" in msg and any(f"holding {n} " in msg for n in held)


def test_corrupt_index(copy41):
    (copy41 / INDEX).write_text("{not json")
    assert INDEX in _load_error(copy41)


def test_nan_scale(copy41):
    name = "layers.1.engram.embed.scale"

    def poison(t):
        t.view(torch.uint8)[17, 0] = 255
        return t

    shard = _rewrite(copy41, name, poison)
    msg = _load_error(copy41)
    assert name in msg and shard.name in msg and "NaN scale" in msg and "[17, 0]" in msg


@pytest.mark.parametrize("name,bad", [("layers.3.hc_ffn_base", float("nan")), ("norm.weight", float("inf")),
                                      ("layers.7.attn.attn_sink", float("-inf"))])
def test_non_finite_values(copy41, name, bad):
    def poison(t):
        t.view(-1)[1] = bad
        return t

    shard = _rewrite(copy41, name, poison)
    msg = _load_error(copy41)
    assert name in msg and shard.name in msg and "non-finite" in msg


def test_v4_routing_table_out_of_range(tmp_path):
    ck = make_checkpoint("tiny-v4", tmp_path / "v4", shard_bytes=1_000_000)
    name = "layers.1.ffn.gate.tid2eid"

    def poison(t):
        t[5, 2] = preset("tiny-v4").n_routed_experts
        return t

    shard = _rewrite(ck, name, poison)
    msg = _load_error(ck)
    assert name in msg and shard.name in msg and "[5, 2]" in msg


def test_skipped_tensors_are_recognised_not_loaded(copy41, caplog):
    extra = {"mtp.0.attn_norm.weight": torch.ones(64, dtype=torch.bfloat16),
             "mtp.2.markov_head.embed.weight": torch.ones(512, 16, dtype=torch.bfloat16),
             "vision.blocks.0.attn.wqkv.weight": torch.ones(12, 4, dtype=torch.bfloat16),
             "aligner.w1.weight": torch.ones(4, 4, dtype=torch.bfloat16),
             "image_newline": torch.ones(64, dtype=torch.bfloat16),
             "layers.3.ffn.gate.bias_vl": torch.zeros(16)}  # tiny-v4.1 is text-only: bias_vl is vision
    save_file(extra, copy41 / "model-extra.safetensors")
    index = _index(copy41)
    index["weight_map"].update(dict.fromkeys(extra, "model-extra.safetensors"))
    _write_index(copy41, index)
    with caplog.at_level(logging.INFO, logger="mini.checkpoint"):
        state = load_state(copy41, progress=False)
    assert not set(extra) & set(state)
    assert set(state) == set(expected_tensors(preset("tiny-v4.1")))
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "2 mtp" in lines[0] and "4 vision" in lines[0]


class _RecordingOpen:
    """Wraps safe_open to record which files are opened and which tensors are read."""

    def __init__(self, real):
        self.real, self.files, self.read = real, [], []

    def __call__(self, path, framework):
        self.files.append(Path(path).name)
        handle = self.real(path, framework)
        recorder = self

        class Handle:
            def __enter__(self):
                self.f = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                recorder.read.append(name)
                return self.f.get_tensor(name)

        return Handle()


def test_ep_subset_reads_only_its_experts(tiny41, monkeypatch):
    full = load_state(tiny41, progress=False)
    rec = _RecordingOpen(load_mod.safe_open)
    monkeypatch.setattr(load_mod, "safe_open", rec)
    sub = load_state(tiny41, experts=range(4, 8), progress=False)
    assert {expert_index(n) for n in sub} == {-1, 4, 5, 6, 7}
    assert {expert_index(n) for n in rec.read} == {-1, 4, 5, 6, 7}  # the other experts are never read
    assert len(rec.read) == len(set(rec.read)) == len(sub)
    _assert_same(sub, {n: full[n] for n in sub})
    with pytest.raises(ValueError, match="out of range"):
        load_state(tiny41, experts=range(14, 17), progress=False)


def test_ep_subset_never_opens_other_experts_shards(tiny41, tmp_path, monkeypatch):
    # re-shard: this rank's experts and everything else in one file, the other ranks' experts in another
    state, mine = load_state(tiny41, progress=False), range(8, 12)
    ck = tmp_path / "ep"
    ck.mkdir()
    shutil.copy(tiny41 / "config.json", ck)
    parts = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, t in state.items():
        other = expert_index(name) >= 0 and expert_index(name) not in mine
        parts["model-00002-of-00002.safetensors" if other else "model-00001-of-00002.safetensors"][name] = t
    for file, tensors in parts.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, ck / file)
    _write_index(ck, {"metadata": {"total_size": 0},
                      "weight_map": {n: f for f, ts in parts.items() for n in ts}})
    other_shard = ck / "model-00002-of-00002.safetensors"
    other_shard.write_bytes(other_shard.read_bytes()[:100])  # damaged: a rank that needs it must fail
    rec = _RecordingOpen(load_mod.safe_open)
    monkeypatch.setattr(load_mod, "safe_open", rec)
    sub = load_state(ck, experts=mine, progress=False)
    assert rec.files == ["model-00001-of-00002.safetensors"]
    _assert_same(sub, {n: state[n] for n in sub})
    assert "model-00002-of-00002.safetensors" in _load_error(ck, experts=range(0, 4))


_MEMORY_PROBE = textwrap.dedent("""
    import sys, torch
    from mini.checkpoint import iter_state, load_state
    from mini.config import ModelConfig
    cfg = ModelConfig.load(sys.argv[1])
    def status_kb(key):  # VmHWM: this process's peak RSS (getrusage's ru_maxrss survives exec from pytest)
        return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")))
    def touch(t):  # one byte of every page
        int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    before = status_kb("VmRSS")
    if sys.argv[2] == "stream":  # consume shard by shard, as a GPU load does (copy, then drop the host view)
        for name, t in iter_state(sys.argv[1], cfg, progress=False):
            touch(t)
    else:  # keep every tensor (memory-mapped) and touch all of them
        state = load_state(sys.argv[1], cfg, progress=False)
        for t in state.values():
            touch(t)
    print(status_kb("VmHWM") - before)
""")


@pytest.mark.slow
def test_peak_host_memory_is_about_one_shard(tmp_path):
    # four large tensors (embed, head, two Engram tables of ~33 MB each) in their own shards, the rest small
    cfg = preset("tiny-v4.1").replace(vocab_size=262144, engram_num_embeddings=(1 << 20, 1 << 20))
    ck = make_checkpoint(cfg, tmp_path / "big", shard_bytes=2 << 20, tokenizer=False)
    shards = [f.stat().st_size for f in ck.glob("model-*.safetensors")]
    total, largest = sum(shards), max(shards)
    assert total > 3.5 * largest

    def peak(mode):
        out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(ck), mode], check=True,
                             capture_output=True, text=True)
        return int(out.stdout.split()[-1]) * 1024

    streamed, kept = peak("stream"), peak("keep")
    print(f"peak RSS growth: streamed {streamed / 2**20:.1f} MiB, all kept {kept / 2**20:.1f} MiB; "
          f"largest shard {largest / 2**20:.1f} MiB, checkpoint {total / 2**20:.1f} MiB")
    assert kept > 0.9 * total  # the probe sees the pages it touches
    # about one shard: its mapped pages plus the copy of the tensor being read out of them (2x the largest shard
    # at worst; 71 MiB seen for a 33 MiB shard in a clean CI run), plus code pages and allocator scratch
    assert streamed < 2 * largest + (32 << 20) and streamed < 0.6 * kept

"""Every model the engine steps offers the whole contract of mini/step.py: each member the protocols declare is
there (the engine never probes for one), with the parameters the engine passes."""
import inspect

import pytest
from fake_model import FakeCache, FakeModel, ScriptedModel

from mini.step import StaticDecode, StepCache, StepModel

INSTANCE_FIELDS = {"config", "max_seqs", "max_rows", "max_len", "device"}  # set in __init__, not on the class


def declared(protocol) -> dict[str, object]:
    """The protocol's members: its annotated fields and its methods, by name."""
    names = {n for n in getattr(protocol, "__annotations__", {})} | {
        n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")}
    return {n: getattr(protocol, n, None) for n in sorted(names)}


def _implementations():
    from mini.model import KVCache, Model
    from mini.model.static_decode import StaticDecodeInputs
    from mini.parallel.dp import DPModel
    return [(StepModel, Model), (StepModel, DPModel), (StepModel, FakeModel), (StepModel, ScriptedModel),
            (StepCache, KVCache), (StepCache, FakeCache), (StaticDecode, StaticDecodeInputs)]


@pytest.mark.parametrize("protocol,cls", _implementations(), ids=lambda x: x.__name__)
def test_every_declared_member_is_there(protocol, cls):
    for name, member in declared(protocol).items():
        if name in INSTANCE_FIELDS:
            continue
        assert hasattr(cls, name), f"{cls.__name__} lacks {protocol.__name__}.{name}"
        if inspect.isfunction(member):
            want = list(inspect.signature(member).parameters)
            got = list(inspect.signature(getattr(cls, name)).parameters)
            assert got[:len(want)] == want or got[1:] == ["args", "kwargs"], (cls.__name__, name, got, want)


def test_the_contract_declares_what_the_engine_calls():
    assert set(declared(StepModel)) == {"config", "capturable", "reads_images", "drafter", "agree_step", "build_batch",
                                        "release_images", "static_decode", "new_cache", "cache_bytes", "forward"}
    assert set(declared(StaticDecode)) == {"max_seqs", "max_rows", "max_len", "device", "batch", "fill",
                                           "replayed"}

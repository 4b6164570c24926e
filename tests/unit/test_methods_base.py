"""The method contract: registry, typed configs, the serving contract and its old-vector rules, the ``none``
baseline, persistence errors, and the shard batches the methods train on."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import shutil

import pytest
import torch
import torch.nn.functional as F
from _compat_pairs import write_shards

import compat.methods
from compat.compat_training import ShardBatches
from compat.methods import METHODS, available_methods, get_method, register_method
from compat.methods.base import CompatMethod
from compat.methods.config import MethodConfig
from compat.methods.contract import CompatError, ServingContract
from compat.methods.model import load_compat_model
from compat.methods.none import PlainModel
from compat.methods.training import cycle_batches
from compat.models import build_model


def test_registry_lists_and_finds_methods():
    names = available_methods()
    assert {"none", "bct", "lambda_orth", "bt2"} <= set(names)
    for name in ("none", "bct", "lambda_orth", "bt2"):
        method = get_method(name)
        assert method.name == name and method.model_class.method == name
    with pytest.raises(KeyError, match="unknown compatibility method 'fct'.*available: .*bct"):
        get_method("fct")

    class Other(CompatMethod):
        model_class = PlainModel

        def fit(self, new, old, batches, config=None):  # pragma: no cover - never called
            raise AssertionError

    with pytest.raises(ValueError, match="'bct' is defined in compat.methods.bct .*not in .*test_methods"):
        register_method("bct")(Other)
    with pytest.raises(ValueError, match="'fct' is not listed in compat.methods.METHODS"):
        register_method("fct")(Other)
    assert "fct" not in available_methods()


def _defined_methods() -> dict[str, list[type[CompatMethod]]]:
    """Module name -> the concrete method classes it defines, for every module under compat/methods
    (walked here on purpose: the registry itself never walks the folder)."""
    defined = {}
    for info in pkgutil.iter_modules(compat.methods.__path__, f"{compat.methods.__name__}."):
        module = importlib.import_module(info.name)
        defined[info.name] = [
            cls
            for cls in vars(module).values()
            if inspect.isclass(cls)
            and issubclass(cls, CompatMethod)
            and cls.__module__ == info.name
            and not inspect.isabstract(cls)
        ]
    return defined


def test_every_method_module_is_listed_and_every_listed_method_is_registered_by_its_module():
    defined = _defined_methods()
    for module, classes in defined.items():
        for cls in classes:
            assert cls.name, f"{module}.{cls.__qualname__} is a method but not @register_method'ed"
            assert METHODS.get(cls.name) == module, f"METHODS does not list {cls.name!r}: {module!r}"
    assert {m for m, classes in defined.items() if classes} == set(METHODS.values())
    for name, module in METHODS.items():
        method = get_method(name)
        assert type(method).__module__ == module and type(method) in defined[module]
        assert method.name == name and method.model_class.method == name


def test_configs_are_typed_and_refuse_unknown_keys():
    method = get_method("lambda_orth")
    config = method.make_config({"steps": 10, "lam": 3, "max_items": None})
    assert config.steps == 10 and config.lam == 3.0 and isinstance(config.lam, float)
    with pytest.raises(CompatError, match="unknown setting\\(s\\) \\['lamda'\\]"):
        method.make_config({"lamda": 3})
    with pytest.raises(CompatError, match="steps: expected an integer"):
        method.make_config({"steps": 2.5})
    with pytest.raises(CompatError, match="lam: expected a number"):
        method.make_config({"lam": "twelve"})


def _contract(**over):
    base = dict(
        method="x",
        space_id="s",
        dim=8,
        old_vector_rule="as_is",
        query_model_version="v2",
        old_space_id="s",
        old_dim=8,
    )
    return ServingContract(**{**base, **over})


def test_serving_contract_validates_and_round_trips():
    c = _contract(old_vector_rule="truncate", dim=12, old_dims=(8, 6))
    assert ServingContract.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.keeps_space and not _contract(space_id="v2").keeps_space
    assert _contract().old_dims == (8,)
    with pytest.raises(CompatError, match="old_vector_rule is 'rotate'"):
        _contract(old_vector_rule="rotate")
    with pytest.raises(CompatError, match="'as_is' needs dim == old_dim"):
        _contract(dim=12)
    with pytest.raises(CompatError, match="'zero_pad' needs old_dim <= dim"):
        _contract(old_vector_rule="zero_pad", dim=6)
    with pytest.raises(CompatError, match="misses field"):
        ServingContract.from_dict({"method": "x"}, "compat.json")


def test_read_rules_score_old_vectors_as_declared():
    bundle = build_model("cf-tiny", seed=0)
    q = F.normalize(torch.randn(4, 8), dim=-1)
    g = F.normalize(torch.randn(5, 6), dim=-1)
    pad = PlainModel(bundle, _contract(old_vector_rule="zero_pad", old_dim=6), MethodConfig())
    trunc = PlainModel(bundle, _contract(old_vector_rule="truncate", old_dim=6), MethodConfig())
    qp, gp = pad.read_old_gallery(q, g)
    qt, gt = trunc.read_old_gallery(q, g)
    # zero_pad: cos(q, [g; 0]); truncate: cos(q[:6], g): the same ranking of old items per query
    assert torch.allclose(qp @ gp.T, (q[:, :6] @ g.T), atol=1e-6)
    assert torch.allclose(qt @ gt.T, F.normalize(q[:, :6], dim=-1) @ g.T, atol=1e-6)
    assert torch.equal((qp @ gp.T).argsort(dim=1), (qt @ gt.T).argsort(dim=1))
    with pytest.raises(CompatError, match="dimension 7"):
        trunc.read_old_gallery(q, torch.randn(2, 7))
    with pytest.raises(NotImplementedError, match="no forward adapter"):
        pad.forward_adapter(g)


def test_none_is_the_independent_model_in_its_own_space(tmp_path):
    old, new = build_model("cf-tiny", seed=0), build_model("cf-small", seed=1)
    method = get_method("none")
    model = method.fit(new, old, [], method.make_config({"version": "v7", "old_space_id": "v6"}))
    c = model.contract
    assert (c.space_id, c.old_space_id, c.keeps_space) == ("v7", "v6", False)
    assert (c.dim, c.old_dim, c.old_vector_rule) == (128, 64, "truncate")
    assert model.trainable_parameters == 0
    texts = ["a red circle", "two blue squares"]
    assert torch.allclose(model.encode_texts(texts), new.encode_texts(texts))
    model.save(tmp_path / "none")
    assert load_compat_model(tmp_path / "none").contract == c
    # a backbone from another save is refused by name
    other = method.fit(build_model("cf-small", seed=2), old, [], method.make_config({"version": "v7"}))
    other.save(tmp_path / "other")
    shutil.copytree(tmp_path / "other" / "new", tmp_path / "mixed" / "new")
    shutil.copy(tmp_path / "none" / "compat.json", tmp_path / "mixed" / "compat.json")
    with pytest.raises(CompatError, match="mixed/new: its weights are not the ones"):
        load_compat_model(tmp_path / "mixed")
    doc = json.loads((tmp_path / "none" / "compat.json").read_text())
    doc["format"] = "something-else"
    (tmp_path / "none" / "compat.json").write_text(json.dumps(doc))
    with pytest.raises(CompatError, match="compat.json: field 'format'"):
        load_compat_model(tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="compat.json is missing"):
        load_compat_model(tmp_path / "nowhere")


def test_cycle_batches_restarts_and_refuses_empty_data():
    assert list(cycle_batches([1, 2, 3], 7)) == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(CompatError, match="produced no batch"):
        list(cycle_batches([], 2))


def test_shard_batches_give_raw_captions_and_new_epochs(tmp_path):
    write_shards(tmp_path, "train", 20, per_shard=8)
    batches = ShardBatches(str(tmp_path / "train-*.tar"), batch_size=6, seed=1)
    first = list(batches)
    assert [len(b.texts) for b in first] == [6, 6, 6]  # full batches only
    assert all(isinstance(t, str) for b in first for t in b.texts) and len(first[0].images) == 6
    second = list(batches)
    assert batches.epoch == 2 and [b.keys for b in second] != [b.keys for b in first]  # another shard order
    keys = [k for b in first for k in b.keys]
    assert len(set(keys)) == 18  # one epoch: no sample twice (the 2 left over do not make a batch)


def test_shard_batches_mix_shards_through_the_shuffle_buffer(tmp_path):
    """Batches of consecutive samples of one shard (one phase, one domain) never meet the other domains'
    items as in-batch negatives; the shuffle buffer mixes shards within a batch, deterministically."""
    write_shards(tmp_path, "train", 24, per_shard=8)

    def shard_of(key: str) -> int:
        return int(key.rsplit("-", 1)[-1]) // 8

    plain = list(ShardBatches(str(tmp_path / "train-*.tar"), batch_size=8, seed=1, shuffle_buffer=0))
    assert all(len({shard_of(k) for k in b.keys}) == 1 for b in plain)  # one shard per batch
    mixed = list(ShardBatches(str(tmp_path / "train-*.tar"), batch_size=8, seed=1))
    assert sorted(k for b in mixed for k in b.keys) == sorted(k for b in plain for k in b.keys)
    assert any(len({shard_of(k) for k in b.keys}) > 1 for b in mixed)
    again = list(ShardBatches(str(tmp_path / "train-*.tar"), batch_size=8, seed=1))
    assert [b.keys for b in again] == [b.keys for b in mixed]
    capped = list(ShardBatches(str(tmp_path / "train-*.tar"), batch_size=4, seed=1, max_samples=12))
    assert sum(len(b.keys) for b in capped) == 12

"""The peer backends (other libraries' input paths): WebDataset for real (a test dependency), MosaicML
Streaming and LitData where installed (`pip install 'loadopt[peers]'`), FFCV's declarations without it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loadopt import recipe
from loadopt.config import config_from_dict
from loadopt.errors import ConfigError
from loadopt.loaders.peers import base as peer_base
from loadopt.loaders.peers import batches as peer_batches
from loadopt.loaders.registry import backend_class, backend_names
from loadopt.loaders.torch_dl.loader import TorchLoader, TorchSettings
from loadopt.schema.documents import ResultsFile
from loadopt.storage.open import open_dataset

from .conftest import tiny_config_dict

PEERS = ["webdataset", "streaming", "litdata"]


def config(tmp_path, **pipeline):
    raw = tiny_config_dict(tmp_path / "out", pipeline={"dtype": "uint8", **pipeline})
    return config_from_dict(raw, "peers.yaml")


def peer(name: str, cfg, seed: int = 3, **settings):
    cls = backend_class(name)
    ok, reason = cls.available()
    if not ok:
        pytest.skip(f"{name}: {reason}")
    return cls(open_dataset(cfg), cfg.pipeline, cls.Settings(**settings), seed=seed)


def epoch_indices(loader) -> list[np.ndarray]:
    return [batch.indices.copy() for batch in loader.host_batches()]


def test_peers_are_registered_and_say_why_not():
    names = backend_names()
    for name in [*PEERS, "ffcv"]:
        assert name in names
        ok, reason = backend_class(name).available()
        assert ok or "pip install" in reason, reason


def test_a_missing_library_is_a_reason_not_an_exception(monkeypatch):
    def broken(name, *args, **kwargs):
        raise RuntimeError(f"{name} is broken here")

    monkeypatch.setattr(peer_base.importlib, "import_module", broken)
    ok, reason = peer_base.library_available("webdataset", "webdataset", peer_base.install_hint("webdataset"))
    assert not ok and "RuntimeError" in reason and "pip install 'loadopt[webdataset]' -c keep.txt" in reason


def test_ffcv_names_what_its_build_lacks():
    ok, reason = backend_class("ffcv").available()
    if ok:
        pytest.skip("ffcv is installed here")
    from loadopt.loaders.peers.ffcv import build_requirements

    for missing in build_requirements():
        assert missing in reason


def test_ffcv_recipe_is_named_as_its_own(tmp_path):
    """FFCV takes no Python transform: its crops are its own, and the recipe says so."""
    cfg = config(tmp_path, dtype="float32")
    cls = backend_class("ffcv")
    if cls.__name__.startswith("Broken_"):
        pytest.skip(cls.available()[1])
    for form in ("jpg", "raw"):
        loader = cls(open_dataset(cfg), cfg.pipeline, cls.Settings(form=form, num_workers=1))
        found = recipe.differences(loader.recipe(), recipe.wanted(cfg.pipeline))
        assert found and "FFCV" in found[0]
        assert "order=ffcv" in loader.describe()


@pytest.mark.parametrize("name", PEERS)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_delivers_every_sample_once_in_the_librarys_order(tmp_path, name, workers):
    cfg = config(tmp_path)
    loader = peer(name, cfg, num_workers=workers)
    try:
        loader.prepare()
        first = epoch_indices(loader)
        assert [len(b) for b in first] == [len(b) for b in loader.order().batches()]
        assert sorted(np.concatenate(first).tolist()) == list(range(48))
        assert loader.epoch == 1
        second = epoch_indices(loader)
        assert sorted(np.concatenate(second).tolist()) == list(range(48))
        assert not np.array_equal(np.concatenate(first), np.concatenate(second))  # shuffled per epoch
        assert f"order={name}" in loader.describe()
    finally:
        loader.close()
    again = peer(name, cfg, num_workers=workers)
    try:
        assert [b.tolist() for b in epoch_indices(again)] == [b.tolist() for b in first]  # seeded: reproducible
    finally:
        again.close()


@pytest.mark.parametrize("name", PEERS)
def test_the_crops_are_the_shared_plan(tmp_path, name):
    """Where the library takes a transform, each sample's pixels are the torch tuned path's for that sample."""
    cfg = config(tmp_path)
    loader = peer(name, cfg, num_workers=1)
    try:
        # the config's training input but for the order (the library's: pipeline.order any allows it)
        assert recipe.differences(loader.recipe(), {**recipe.wanted(cfg.pipeline), "order": "any"}) == []
        got = {}
        finished = [inputs for inputs, _ in loader]  # one pass: the finishing runs
        loader.set_epoch(0)
        for batch in loader.host_batches():
            got.update({int(i): batch.inputs[k].clone() for k, i in enumerate(batch.indices)})
    finally:
        loader.close()
    reference = TorchLoader(open_dataset(cfg), cfg.pipeline, TorchSettings(num_workers=0), seed=3)
    for batch in reference.host_batches():
        for k, index in enumerate(batch.indices):
            assert torch.equal(got[int(index)], batch.inputs[k]), f"sample {index}"
    assert finished[0].dtype == torch.uint8 and finished[0].shape[1:] == (3, 48, 48)


def test_webdataset_conversion_is_made_once(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    loader = peer("webdataset", cfg, num_workers=0)
    loader.prepare()
    files = loader.storage_files()
    assert files and all(f.endswith(".tar") for f in files)
    assert loader.meta.samples == 48 and len(loader.meta.shards) >= 2
    before = {f: (tmp_path / f).stat().st_mtime_ns for f in files}

    def again(*args):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(type(loader), "_write", again)
    second = peer("webdataset", cfg, num_workers=0)
    second.prepare()
    assert second.path == loader.path and {f: (tmp_path / f).stat().st_mtime_ns for f in files} == before
    assert not [p for p in loader.path.parent.iterdir() if ".tmp-" in p.name]  # no temporary folder left


def test_webdataset_missing_conversion_is_an_error_when_asked_not_to_convert(tmp_path, own_cache):
    from loadopt.errors import DatasetError

    loader = peer("webdataset", config(tmp_path), num_workers=0)
    with pytest.raises(DatasetError, match="no webdataset conversion"):
        loader.prepare(convert_missing=False)


def test_webdataset_resumes_mid_epoch_without_repeats(tmp_path):
    cfg = config(tmp_path)
    whole = peer("webdataset", cfg, num_workers=2)
    full = epoch_indices(whole)
    whole.close()
    first = peer("webdataset", cfg, num_workers=2)
    batches = first.host_batches()
    taken = [next(batches).indices.copy() for _ in range(2)]
    batches.close()
    state = first.state_dict()
    first.close()
    resumed = peer("webdataset", cfg, num_workers=2)
    resumed.load_state_dict(state)
    rest = [batch.indices.copy() for _, batch in zip(range(100), resumed.host_batches(), strict=False)]
    assert [b.tolist() for b in taken + rest] == [b.tolist() for b in full]


def test_webdataset_runs_in_the_harness(tmp_path):
    from loadopt.bench.accelerator import EmulatedAccelerator
    from loadopt.bench.harness import run_repeat
    from loadopt.device import DeviceTransfer

    cfg = config(tmp_path, dtype="float32")
    loader = peer("webdataset", cfg, num_workers=1)
    try:
        loader.prepare()
        transfer = DeviceTransfer(loader.device, emulate=True)
        result = run_repeat(loader, EmulatedAccelerator(0.0, loader.device), transfer, warmup_batches=1,
                            measure_batches=8)  # crosses into the second epoch
    finally:
        loader.close()
    assert result.metrics["samples"] == 8 * 8 and result.metrics["samples_per_s"] > 0


@pytest.mark.parametrize("form", ["jpg", "raw"])
def test_ffcv_delivers_every_sample_once_per_epoch_in_its_order(tmp_path, form):
    """FFCV where it is installed (`pip install 'loadopt[peers-ffcv]'`): its .beton, its threads and order,
    every sample once per epoch, reshuffled the next, uint8 crops of the config's size in FFCV's NHWC memory;
    its bare loop hands its own buffers over uncopied; in the harness too."""
    from loadopt.bench.accelerator import EmulatedAccelerator
    from loadopt.bench.harness import run_repeat
    from loadopt.device import DeviceTransfer

    cfg = config(tmp_path)
    loader = peer("ffcv", cfg, num_workers=1, form=form)
    try:
        loader.prepare()
        batches = list(loader.host_batches())
        assert all(b.inputs.dtype == torch.uint8 and b.inputs.shape == (8, 48, 48, 3) and b.layout == "NHWC"
                   and b.inputs.is_contiguous() and b.borrowed for b in batches)
        bare = loader.bare_batches(5)
        images, labels, layout = next(bare)
        assert layout == "NHWC" and images.shape == (8, 48, 48, 3) and images.is_contiguous() and len(labels) == 8
        bare.close()
        first = [b.indices for b in batches]
        second = epoch_indices(loader)
        for epoch in (first, second):
            assert sorted(np.concatenate(epoch).tolist()) == list(range(48))
        assert not np.array_equal(np.concatenate(first), np.concatenate(second))  # shuffled per epoch
        assert "order=ffcv" in loader.describe() and loader.recipe()["order"] == "ffcv"
        transfer = DeviceTransfer(loader.device, emulate=True)
        result = run_repeat(loader, EmulatedAccelerator(0.0, loader.device), transfer, warmup_batches=1,
                            measure_batches=8)  # crosses into the next epoch
        assert result.metrics["samples"] == 8 * 8 and result.metrics["samples_per_s"] > 0
    finally:
        loader.close()


def test_peers_refuse_what_they_cannot_do(tmp_path):
    cfg = config(tmp_path)
    cls = backend_class("webdataset")
    with pytest.raises(ConfigError, match="one rank"):
        cls(open_dataset(cfg), cfg.pipeline, cls.Settings(), rank=0, world_size=2)


def test_rebatch_cuts_the_librarys_batches_to_the_planned_sizes():
    def part(indices, failed=()):
        n = len(indices)
        return {"inputs": torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1) + indices[0] if n else
                torch.empty((0, 1, 1, 1), dtype=torch.uint8), "labels": torch.zeros(n, dtype=torch.int64),
                "indices": torch.tensor(indices, dtype=torch.int64), "failures": [(i, "bad") for i in failed]}

    stream = [part([0, 1, 2]), part([3, 4], failed=[5]), part([6, 7, 8])]
    out = list(peer_batches.rebatch(iter(stream), [4, 4, 1]))
    # a part's failures count first: batch 0 is samples 0-2 and the failed 5
    assert [b.indices.tolist() for b in out] == [[0, 1, 2], [3, 4, 6, 7], [8]]
    assert [b.failures for b in out] == [[(5, "bad")], [], []]
    assert out[1].inputs.flatten().tolist() == [3, 4, 6, 7] and out[0].inputs.flatten().tolist() == [0, 1, 2]
    resumed = list(peer_batches.rebatch(iter(stream), [4, 1], skip=4))
    assert [b.indices.tolist() for b in resumed] == [[3, 4, 6, 7], [8]]
    short = list(peer_batches.rebatch(iter(stream[:1]), [4, 4]))
    assert [b.indices.tolist() for b in short] == [[0, 1, 2]]
    assert {b.layout for b in out} == {"NCHW"}  # a part without "layout" (a library's own collate) is NCHW
    nhwc = [{**p, "inputs": p["inputs"].permute(0, 2, 3, 1), "layout": "NHWC"} for p in stream]
    assert {b.layout for b in peer_batches.rebatch(iter(nhwc), [4, 4, 1])} == {"NHWC"}


def test_rebatch_copies_what_it_keeps_of_a_borrowed_buffer_before_the_next():
    """A library that reuses one buffer (as FFCV does): what `rebatch` holds past a yield is copied before the
    next batch is asked for; a batch passed through whole stays borrowed (finished before the next)."""
    buffer = torch.zeros((3, 1, 1, 1), dtype=torch.uint8)

    def library():
        for first in (0, 3, 6):
            buffer.copy_(torch.arange(first, first + 3, dtype=torch.uint8).view(3, 1, 1, 1))  # reused in place
            yield {"inputs": buffer, "labels": torch.zeros(3, dtype=torch.int64),
                   "indices": torch.arange(first, first + 3), "failures": [], "borrowed": True}

    seen = []
    for batch in peer_batches.rebatch(library(), [2, 2, 2, 3]):
        seen.append((batch.inputs.flatten().tolist(), batch.borrowed))  # consumed before the next, as finish does
    assert seen == [([0, 1], True), ([2, 3], False), ([4, 5], True), ([6, 7, 8], True)]
    whole = list(peer_batches.rebatch(library(), [3, 3, 3]))
    assert all(b.borrowed for b in whole) and whole[0].inputs.data_ptr() == buffer.data_ptr()


def test_the_bare_loop_is_the_librarys_batches_as_handed_over(tmp_path):
    """`bare_batches` (benchmarks/peers.py --truth's reference): the library's own batches, uncut and uncopied."""
    cfg = config(tmp_path)
    loader = peer("webdataset", cfg, num_workers=0)
    try:
        library = list(loader.library_batches(2))
        bare = list(loader.bare_batches(2))
    finally:
        loader.close()
    assert [layout for _, _, layout in bare] == ["NHWC"] * len(library)
    for (inputs, labels, _), batch in zip(bare, library, strict=True):
        assert torch.equal(inputs, batch["inputs"]) and torch.equal(labels, batch["labels"])


@pytest.mark.parametrize("workers", [0, 1])
def test_webdataset_reads_its_shards_through_the_tier(tmp_path, workers):
    from loadopt.storage.tiers.stack import tier_counters

    cfg = config_from_dict(tiny_config_dict(tmp_path / "out", pipeline={"dtype": "uint8"},
                                            storage={"tier": {"name": "fast", "bandwidth_mb_s": 2000}}), "tier.yaml")
    loader = peer("webdataset", cfg, num_workers=workers)
    loader.prepare()
    assert "via tier" in loader.describe()
    before = tier_counters(loader.dataset.fs)
    indices = np.concatenate(epoch_indices(loader))
    after = tier_counters(loader.dataset.fs)
    loader.close()
    assert sorted(indices.tolist()) == list(range(48))
    assert after["bytes"] - before["bytes"] >= 0.95 * loader.counters.bytes_read > 0  # the tar shards, headers too


@pytest.mark.parametrize("name", ["streaming", "litdata"])
def test_peers_that_read_local_files_refuse_a_tier(tmp_path, name):
    tier = {"tier": {"name": "fast", "bandwidth_mb_s": 2000}}
    cfg = config_from_dict(tiny_config_dict(tmp_path / "out", storage=tier), "tier.yaml")
    loader = peer(name, cfg, num_workers=0)
    with pytest.raises(ConfigError, match="storage.tier"):
        loader.prepare()


def test_loadopt_bench_measures_a_peer_beside_a_builtin(tmp_path):
    """`loadopt bench` treats a peer like any backend: a row with its label, recipe and metrics, held to the
    ceiling its recipe says bounds it (it decodes the source JPEGs); an absent peer is a row that says why."""
    from loadopt.bench.runner import run_bench

    raw = tiny_config_dict(tmp_path / "out", loaders={"torch": {"variant": "tuned", "num_workers": 0},
                                                       "webdataset": {"num_workers": 1}, "ffcv": {"num_workers": 1}})
    outcome = run_bench(config_from_dict(raw, "tiny.yaml"))
    results = outcome.document()
    rows = {r["backend"]: r for r in results["runs"]}
    assert rows["webdataset"]["metrics"] and "order=webdataset" in rows["webdataset"]["label"]
    assert "decode" in rows["webdataset"]["ceiling"]["name"], rows["webdataset"]["ceiling"]
    assert recipe.differences(rows["webdataset"]["recipe"], {**results["recipe"], "order": "any"}) == []
    from loadopt.bench.decision import recipe_exclusions

    passed_over = recipe_exclusions(outcome.results)  # by the decision and auto: its order
    assert rows["webdataset"]["label"] in passed_over and rows["torch"]["label"] not in passed_over
    if not backend_class("ffcv").available()[0]:
        assert "metrics" not in rows["ffcv"] and "ffcv" in json.dumps(rows["ffcv"])


def _bench_results(pipeline, dataset, runs: list[tuple[str, str, dict, float, dict]]) -> ResultsFile:
    """A finished bench's results (fastest first) as `decision.make_decision` reads them."""
    from loadopt.bench import decision

    return ResultsFile.model_validate_json(json.dumps({
        "created": "2026-12-01T00:00:00+00:00", "device": "cpu", "config_source": "peers.yaml",
        "machine": decision.machine_info(), "config": {"pipeline": pipeline.model_dump(mode="json")},
        "dataset": {"fingerprint": dataset.fingerprint}, "recipe": recipe.wanted(pipeline),
        "runs": [{"backend": backend, "label": label, "settings": settings, "status": "ok", "recipe": delivered,
                  "metrics": {"samples_per_s": {"median": rate}}}
                 for label, backend, settings, rate, delivered in runs],
        "ranking": [run[0] for run in runs]}))


def test_auto_keeps_the_samplers_order_unless_the_config_allows_a_librarys(tmp_path, own_cache, caplog):
    """A drop-in for DataLoader keeps the user's order: a peer (its library's order) that won the bench is
    passed over by the decision and `auto`, named in the reason, unless `pipeline.order: any` allows it;
    a decision naming it anyway (an older loadopt's) is not followed."""
    from loadopt import make_loader
    from loadopt.bench import decision

    cls = backend_class("webdataset")
    if not cls.available()[0]:
        pytest.skip(cls.available()[1])
    raw = tiny_config_dict(tmp_path / "out", loaders={})
    for order, winner in (("shared", "torch"), ("any", "webdataset")):
        raw["pipeline"] = {**raw["pipeline"], "order": order}
        cfg = config_from_dict(raw, "peers.yaml")
        dataset = open_dataset(cfg)
        webdataset = cls(dataset, cfg.pipeline, cls.Settings(num_workers=0))
        torch_tuned = TorchLoader(dataset, cfg.pipeline, TorchSettings(variant="tuned", num_workers=0))
        assert webdataset.recipe()["order"] == "webdataset" and "order" not in torch_tuned.recipe()
        results = _bench_results(cfg.pipeline, dataset, [
            ("webdataset", "webdataset", {"num_workers": 0}, 900.0, webdataset.recipe()),
            ("torch tuned", "torch", {"variant": "tuned", "num_workers": 0}, 600.0, torch_tuned.recipe())])
        made = decision.make_decision(results, decision.storage_tier(cfg.storage.tier, dataset.root))
        assert made is not None and made.backend == winner
        if order == "shared":
            assert made.passed_over_for_order == ["webdataset"] and "webdataset" in made.text
            assert "order webdataset's own" in made.excluded[0].differences[0]
        else:
            assert made.passed_over_for_order == [] and made.excluded == []
        decision.record(made, None)
        caplog.clear()
        caplog.set_level("INFO", logger="loadopt.api")
        chosen = make_loader(cfg, num_workers=0)  # auto
        try:
            assert chosen.name == winner
            if order == "shared":
                assert "passed over for their library's own order" in caplog.text and "webdataset" in caplog.text
        finally:
            chosen.close()

    raw["pipeline"] = {**raw["pipeline"], "order": "shared"}
    cfg = config_from_dict(raw, "peers.yaml")
    decision.record(made.model_copy(update={"pipeline": cfg.pipeline.model_dump(mode="json")}), None)  # webdataset
    caplog.clear()
    chosen = make_loader(cfg, num_workers=0)
    try:
        assert chosen.shared_order and "not used" in caplog.text and "order webdataset's own" in caplog.text
    finally:
        chosen.close()

"""The job's own pipeline on every path: its dataset object (a torch Dataset class, a Hugging Face dataset) and its
per-sample transform give equal batches on torch, arrow and posix, in any worker count and across a resume; the
transform's draws are seeded per sample; what a user can get wrong is one line."""

import subprocess
import sys

import pytest
import torch

from loadopt import make_loader
from loadopt.errors import BackendUnavailable, ConfigError, DatasetError

from .own_job import EXAMPLE, assert_same, epoch_of, own_augment, own_data


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return own_data.write_folder(tmp_path_factory.mktemp("own") / "data", count=40)

# Every path that runs a per-sample transform: (label, backend, its settings).
PATHS = [
    ("torch tuned w=0", "torch", {"variant": "tuned", "num_workers": 0}),
    ("torch tuned w=2", "torch", {"variant": "tuned", "num_workers": 2}),
    ("arrow encoded, processes", "arrow", {"form": "encoded", "crop_in": "processes", "threads": 2}),
    ("arrow encoded, threads", "arrow", {"form": "encoded", "crop_in": "threads", "threads": 2}),
    ("posix encoded, processes", "posix", {"form": "encoded", "threads": 2, "crop_in": "processes"}),
    ("posix encoded, threads", "posix", {"form": "encoded", "threads": 2, "crop_in": "threads"}),
    ("dali external", "dali", {"reader": "external"}),
    ("dali arrow", "dali", {"reader": "external", "source": "arrow"}),
]
# augment: none hands the transform the decoded image: the plain variant's PIL decode is the same pixels.
PATHS_NONE = [*PATHS, ("torch plain w=2", "torch", {"variant": "plain", "num_workers": 2})]


@pytest.mark.parametrize("augment, transform, paths", [("train", own_augment.train, PATHS),
                                                         ("none", own_augment.crop_and_jitter, PATHS_NONE)])
def test_own_dataset_and_transform_give_equal_batches_on_every_path(folder, augment, transform, paths):
    dataset = own_data.CaptionedSamples(folder)  # dict items: image, label and caption
    size = 48 if augment == "train" else own_augment.SIZE
    epochs = {}
    for label, backend, settings in paths:
        loader = make_loader(dataset, backend=backend, transform=transform, batch_size=8, image_size=size,
                             shuffle=True, seed=3, augment=augment, dtype="uint8", **settings)
        epochs[label] = [epoch_of(loader), epoch_of(loader)]
        loader.close()
    reference_label = paths[0][0]
    reference = epochs[reference_label]
    labels = torch.cat([batch[1] for batch in reference[0]])
    assert sorted(labels.tolist()) == sorted(dataset.targets)  # every sample once, with its own label
    captions = [caption for batch in reference[0] for caption in batch[2]["caption"]]
    assert sorted(captions) == sorted(dataset.caption(i) for i in range(len(dataset)))
    assert all(f"class {label}," in caption for label, caption in zip(labels.tolist(), captions, strict=True))
    for label, got in epochs.items():
        for epoch in (0, 1):
            assert_same(reference[epoch], got[epoch], f"{label} against {reference_label}, epoch {epoch}")
    # the transform's draws move with the epoch (as do the crop's)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(reference[0], reference[1], strict=True))


def test_the_transform_is_run_and_seeded_per_sample(folder):
    dataset = own_data.CaptionedJpegs(folder)
    common = {"batch_size": 8, "image_size": 48, "shuffle": False, "dtype": "uint8"}
    plain = epoch_of(make_loader(dataset, backend="torch", num_workers=0, **common))
    transformed = epoch_of(make_loader(dataset, backend="torch", num_workers=0, transform=own_augment.train, **common))
    assert not torch.equal(plain[0][0], transformed[0][0])
    # a sample's draw is its own: the same sample in another batch position, batch size and order gets it too
    alone = epoch_of(make_loader(dataset, backend="arrow", form="encoded", transform=own_augment.train,
                                 **{**common, "batch_size": 5}))
    assert torch.equal(torch.cat([x for x, _ in alone]), torch.cat([x for x, _ in transformed]))


@pytest.mark.parametrize("resumed_on", ["arrow", "posix", "dali"])
def test_a_resume_on_another_path_continues_with_the_same_draws(folder, resumed_on):
    dataset = own_data.CaptionedSamples(folder)
    common = {"batch_size": 8, "image_size": 48, "shuffle": True, "seed": 5, "dtype": "uint8",
              "transform": own_augment.train}
    whole = epoch_of(make_loader(dataset, backend="torch", num_workers=2, **common))
    first = make_loader(dataset, backend="torch", num_workers=2, **common)
    head = epoch_of(first, batches=2)
    state = first.state_dict()
    rest_loader = make_loader(dataset, backend=resumed_on, **({} if resumed_on == "dali" else {"form": "encoded"}),
                              **common)
    rest_loader.load_state_dict(state)
    assert_same(whole, head + epoch_of(rest_loader), f"torch for 2 batches, then {resumed_on}")


def test_lightning_advances_the_epoch_through_the_sampler(folder):
    lightning = pytest.importorskip("lightning")
    dataset = own_data.CaptionedJpegs(folder)
    loader = make_loader(dataset, backend="torch", num_workers=0, batch_size=4, image_size=32, shuffle=True)
    seen: dict[int, list[list[int]]] = {}

    class Model(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3 * 32 * 32, 4)

        def training_step(self, batch, index):
            inputs, labels = batch
            seen.setdefault(self.current_epoch, []).append(labels.tolist())
            return torch.nn.functional.cross_entropy(self.layer(inputs.flatten(1)), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = lightning.Trainer(max_epochs=2, limit_train_batches=3, accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), train_dataloaders=loader)
    assert len(seen[0]) == len(seen[1]) == 3
    assert seen[0] != seen[1], "epoch 1 repeated epoch 0's batches"
    assert loader.epoch == 1


def test_lightning_resumes_mid_epoch_from_its_checkpoint(folder, tmp_path):
    """Lightning keeps a stateful loader's `state_dict` in its checkpoints: resumed at step 6 of 10 in epoch 0, the
    run continues with the batches the uninterrupted one had from there, through epoch 1."""
    lightning = pytest.importorskip("lightning")
    seen: list[tuple[int, list[int]]] = []

    class Model(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3 * 32 * 32, 4)

        def training_step(self, batch, index):
            seen.append((self.current_epoch, batch[1].tolist()))
            return torch.nn.functional.cross_entropy(self.layer(batch[0].flatten(1)), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def loader():
        return make_loader(own_data.CaptionedJpegs(folder), backend="torch", num_workers=0, batch_size=4,
                           image_size=32, shuffle=True, transform=own_augment.train)

    quiet = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
             "max_epochs": 2}
    saving = lightning.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1,
                                                         filename="{step}")
    lightning.Trainer(callbacks=[saving], **quiet).fit(Model(), train_dataloaders=loader())
    whole = list(seen)
    seen.clear()
    lightning.Trainer(callbacks=[saving], **quiet).fit(Model(), train_dataloaders=loader(),
                                                       ckpt_path=str(tmp_path / "step=6.ckpt"))
    assert len(whole) == 20 and seen == whole[6:]


def test_a_config_names_the_factory_and_the_transform(folder, monkeypatch):
    monkeypatch.setenv("OWN_DATA", str(folder.parent))
    config = {"dataset": {"factory": "own_data:make"},
              "pipeline": {"batch_size": 8, "image_size": 64, "augment": "none",
                           "transform": "own_augment:crop_and_jitter", "dtype": "uint8"}}
    loader = make_loader(config, backend="posix", form="encoded")
    assert loader.dataset.root == "factory own_data:make"
    assert loader.recipe()["transform"] == "own_augment:crop_and_jitter"
    assert len(epoch_of(loader)) == 5
    with pytest.raises(BackendUnavailable, match="dali reader native: DALI's own reader, crops and order"):
        make_loader(config, backend="dali", reader="native")
    from loadopt.loaders.registry import backend_class

    kvikio = backend_class("kvikio")  # finished on the device: said whether or not this machine has one
    runs, why = kvikio.runs_pipeline(loader.pipeline, kvikio.Settings())
    assert not runs and why == ("kvikio does not run a per-sample Python transform (pipeline.transform); torch, "
                                "arrow, posix and dali do")


def test_the_fingerprint_changes_when_a_sample_does(tmp_path):
    from loadopt.config_models import Config
    from loadopt.storage.sources.user import from_object

    split = own_data.write_folder(tmp_path / "data", count=8)
    before = from_object(own_data.CaptionedJpegs(split), Config()).fingerprint
    path = sorted(split.glob("*/*.jpg"))[3]
    from PIL import Image

    Image.new("RGB", (50, 60), (1, 2, 3)).save(path, quality=90)
    assert from_object(own_data.CaptionedJpegs(split), Config()).fingerprint != before


def broken(image):
    raise ValueError("no such lens")


def returns_floats(image):
    return torch.zeros(3, 48, 48)


@pytest.mark.parametrize("transform, expected", [
    (broken, r"python:own_data.CaptionedJpegs\[\d+\]: pipeline.transform (tests\.)?test_own_pipeline:broken raised "
             r"ValueError: no such lens( \(sample \d+\))? \(set dataset.on_error: skip to skip it\)"),
    (returns_floats, r"pipeline.transform (tests\.)?test_own_pipeline:returns_floats returned float32 pixels of shape "
                     r"\(48, 48, 3\); loadopt batches uint8 images of 48x48"),
])
def test_a_transform_that_fails_is_one_line_naming_the_sample(folder, transform, expected):
    dataset = own_data.CaptionedJpegs(folder)
    for backend, settings in [("torch", {"num_workers": 2}), ("arrow", {"form": "encoded"})]:
        loader = make_loader(dataset, backend=backend, transform=transform, batch_size=8, image_size=48, **settings)
        with pytest.raises(DatasetError, match=expected) as caught:
            epoch_of(loader)
        assert "\n" not in str(caught.value)
        loader.close()


def test_a_failing_transform_under_on_error_skip_skips_and_counts(folder):
    def unlucky(image):
        if own_augment.random.random() < 0.3:  # the seeded draw: the same samples fail on every path
            raise ValueError("unlucky")
        return own_augment.train(image)

    dataset = own_data.CaptionedJpegs(folder)
    counts = []
    for backend, settings in [("torch", {"num_workers": 2}), ("posix", {"form": "encoded"})]:
        loader = make_loader(dataset, backend=backend, transform=unlucky, batch_size=8, image_size=48,
                             on_error="skip", **settings)
        delivered = sum(len(labels) for _, labels in epoch_of(loader))
        counts.append((delivered, sorted(path for path, _ in loader.counters.skipped)))
    assert counts[0] == counts[1]
    delivered, skipped = counts[0]
    assert skipped and delivered + len(skipped) == len(dataset)


@pytest.mark.parametrize("given, expected", [
    (42, r"python:builtins.int: a int is not a dataset loadopt reads; it reads a map-style torch.utils.data.Dataset"),
    ([(torch.zeros(3, 8, 8), 1)], r"python:builtins.list: sample 0's image is a float32 Tensor of shape "
                                  r"\(3, 8, 8\); loadopt reads encoded image bytes, PIL images and uint8 pixels"),
])
def test_what_is_not_a_dataset_is_one_line(given, expected):
    with pytest.raises((ConfigError, DatasetError), match=expected) as caught:
        make_loader(given, backend="torch")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("key, value, expected", [
    ("pipeline.transform", "own_augment:nothing_here", "pipeline.transform: 'own_augment:nothing_here': own_augment "
                                                       "has no 'nothing_here'"),
    ("pipeline.transform", "no_such_module:f", "cannot import no_such_module"),
    ("dataset.factory", "own_augment:SIZE", "dataset.factory: 'own_augment:SIZE' is a int, not a function"),
])
def test_a_name_that_does_not_import_is_one_line(key, value, expected):
    section, name = key.split(".")
    config = {section: {name: value}, "pipeline": {"batch_size": 8, "image_size": 48}} if section == "dataset" else \
        {"pipeline": {"batch_size": 8, "image_size": 48, name: value}}
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        epoch_of(make_loader(config, backend="torch", num_workers=0))


def test_loadopt_bench_runs_the_own_pipeline_through_every_backend(folder, tmp_path):
    import json
    import os

    env = {**os.environ, "OWN_DATA": str(folder.parent), "LOADOPT_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "loadopt", "bench", "own.yaml", "--quick", "--set",
                           f"report.out={tmp_path / 'out'}"], cwd=EXAMPLE, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    status = {run["backend"] + " " + str(run.get("settings", {}).get("num_workers", "")): run["status"]
              for run in results["runs"]}
    assert sorted(status.items()) == [("arrow ", "ok"), ("dali ", "ok"), ("posix ", "ok"), ("torch 0", "ok"),
                                      ("torch 2", "ok")], status


class Unpicklable(own_data.CaptionedJpegs):
    def __init__(self, root):
        super().__init__(root)
        self.opener = lambda path: path  # a lambda: pickle refuses it


def test_a_dataset_that_cannot_be_sent_to_spawned_workers_is_one_line(folder, monkeypatch):
    import multiprocessing

    loader = make_loader(Unpicklable(folder), backend="torch", num_workers=2, batch_size=8, image_size=32)
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "spawn")
    with pytest.raises(DatasetError, match=r"^python:(tests\.)?test_own_pipeline.Unpicklable: cannot be sent to the "
                                           r"worker processes \(start method spawn: .*\): .*; make it picklable, or "
                                           r"use num_workers=0$"):
        epoch_of(loader)


class BoxedSamples(torch.utils.data.Dataset):
    """A detection job's dataset: dark JPEGs of varying size with one bright rectangle, its box a field."""

    def __init__(self, count=24):
        import io
        import random

        from PIL import Image, ImageDraw

        draw = random.Random(7)
        self.items = []
        for index in range(count):
            width, height = draw.randint(60, 120), draw.randint(50, 100)
            x0, y0 = draw.randint(0, width // 2), draw.randint(0, height // 2)
            box = [x0, y0, x0 + draw.randint(width // 4, width // 2), y0 + draw.randint(height // 4, height // 2)]
            image = Image.new("RGB", (width, height), (20, 20, 20))
            ImageDraw.Draw(image).rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=(240, 240, 240))
            encoded = io.BytesIO()
            image.save(encoded, "JPEG", quality=95)
            self.items.append({"image": encoded.getvalue(), "label": index % 3, "boxes": [box]})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def test_a_transform_of_image_and_target_moves_the_boxes_with_the_pixels_on_every_path():
    dataset = BoxedSamples()
    epochs = {}
    for label, backend, settings in PATHS_NONE:
        loader = make_loader(dataset, backend=backend, transform=own_augment.resize_and_flip_boxes,
                             transform_target=True, batch_size=8, image_size=own_augment.SIZE, shuffle=True, seed=3,
                             augment="none", dtype="uint8", **settings)
        epochs[label] = [epoch_of(loader), epoch_of(loader)]
        loader.close()
    reference_label = PATHS_NONE[0][0]
    reference = epochs[reference_label]
    for label, got in epochs.items():
        for epoch in (0, 1):
            assert_same(reference[epoch], got[epoch], f"{label} against {reference_label}, epoch {epoch}")
    for inputs, labels, fields in reference[0]:
        boxes = fields["boxes"]
        assert isinstance(boxes, torch.Tensor) and boxes.shape == (len(labels), 1, 4)
        for pixels, box in zip(inputs, boxes[:, 0], strict=True):  # the bright rectangle is where its box now says
            gray = pixels.float().mean(0) if pixels.shape[0] == 3 else pixels.float().mean(-1)
            x0, y0, x1, y1 = (int(round(v)) for v in box.tolist())
            inside = gray[y0 + 1 : y1 - 1, x0 + 1 : x1 - 1].mean()
            outside = torch.cat([gray[:, : max(x0 - 1, 0)].flatten(), gray[:, x1 + 1 :].flatten()]).mean()
            assert inside > 200 and (outside != outside or outside < 60), (box, inside, outside)
    # the flips are drawn per sample and epoch: the epochs' boxes differ
    boxes_of = [sorted(box for batch in epoch for box in batch[2]["boxes"][:, 0].tolist()) for epoch in reference]
    assert boxes_of[0] != boxes_of[1]
    epoch_labels = torch.cat([batch[1] for batch in reference[0]])
    assert sorted(epoch_labels.tolist()) == sorted(item["label"] for item in dataset.items)


def forgets_the_target(image, target):
    return own_augment.resize_and_flip_boxes(image, target)[0]


def drops_the_boxes(image, target):
    image, target = own_augment.resize_and_flip_boxes(image, target)
    return image, {"label": target["label"]}


@pytest.mark.parametrize("transform, expected", [
    (forgets_the_target, r"forgets_the_target returned a Image; a transform of \(image, target\) returns "
                         r"\(image, target\)"),
    (drops_the_boxes, r"drops_the_boxes returned a target without 'boxes'"),
])
def test_a_transform_of_image_and_target_that_returns_less_is_one_line(transform, expected):
    for backend, settings in [("torch", {"num_workers": 2}), ("arrow", {"form": "encoded"})]:
        loader = make_loader(BoxedSamples(8), backend=backend, transform=transform, transform_target=True,
                             augment="none", batch_size=4, image_size=own_augment.SIZE, **settings)
        with pytest.raises(DatasetError, match=expected) as caught:
            epoch_of(loader)
        assert "\n" not in str(caught.value)
        loader.close()

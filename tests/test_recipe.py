"""The same training input on every path (loadopt.recipe): crop boxes, flips, and `auto` never crossing recipes.

The crop-box test reads each backend's boxes back out of the pixels it delivers: the source images
are gradients (red rises with x, green with y), so a delivered crop's red and green ramps give its box
in source pixels and whether it was flipped, whatever the backend does inside (worker processes, DALI's
engine, decoded frames stored at a lower resolution).
"""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from loadopt import make_loader, recipe
from loadopt.bench import decision
from loadopt.config import config_from_dict
from loadopt.imaging.frames import scaled_frame
from loadopt.loaders import transforms
from loadopt.loaders.registry import backend_class
from loadopt.schema.documents import ResultsFile

LOW, SPAN = 20.0, 215.0  # the ramps run from 20 to 235: away from clipping at 0 and 255
SIZE, MAX_SIDE, SEED = 64, 200, 3
# (width, height): some within max_side (stored at their own pixels), most shrunk (about 2 source px a stored one)
FRAMES = [(150, 120), (190, 200), (240, 180), (320, 240), (400, 300), (300, 400), (360, 200), (210, 350)]


def gradient_jpeg(width: int, height: int) -> bytes:
    x = (np.arange(width) + 0.5) / width
    y = (np.arange(height) + 0.5) / height
    pixels = np.empty((height, width, 3), np.float64)
    pixels[..., 0], pixels[..., 1], pixels[..., 2] = LOW + SPAN * x[None, :], LOW + SPAN * y[:, None], 128
    out = io.BytesIO()
    Image.fromarray(np.round(pixels).astype(np.uint8)).save(out, format="JPEG", quality=98, subsampling=0)
    return out.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("gradients")
    for n in range(24):
        width, height = FRAMES[n % len(FRAMES)]
        target = root / "train" / f"c{n % 3}"
        target.mkdir(parents=True, exist_ok=True)
        (target / f"{n:02d}.jpg").write_bytes(gradient_jpeg(width, height))
    return root


def gradient_config(folder, tmp_path, augment="train"):
    return config_from_dict({
        "name": "gradients", "seed": SEED, "dataset": {"path": str(folder)},
        "pipeline": {"batch_size": 8, "image_size": SIZE, "augment": augment, "dtype": "uint8", "max_side": MAX_SIDE},
        "workload": {"step_time_ms": 0, "warmup_batches": 0, "measure_batches": 3, "repeats": 1},
        "loaders": {"torch": {"num_workers": 0}}, "report": {"out": str(tmp_path / "out")},
    }, "gradients.yaml")


def read_box(chw: torch.Tensor, width: int, height: int) -> tuple[np.ndarray, bool]:
    """(left, top, right, bottom) in source pixels and the flip, from a delivered crop of a gradient:
    a line fitted to the red ramp along x (green along y), averaged over the other axis; the outer
    3 pixels left out (the resize filter's support is cut at the crop's edge there)."""
    size = chw.shape[-1]
    centres = np.arange(size) + 0.5
    keep = slice(3, size - 3)
    red = chw[0].double().mean(0).numpy()  # per output column
    green = chw[1].double().mean(1).numpy()  # per output row
    ends = []
    for ramp, extent in ((red, width), (green, height)):
        slope, intercept = np.polyfit(centres[keep], ramp[keep], 1)
        first, last = ((intercept + slope * np.array([0.0, size])) - LOW) * extent / SPAN
        ends.append((first, last))
    (x0, x1), (y0, y1) = ends
    flip = x1 < x0
    return np.array([min(x0, x1), y0, max(x0, x1), y1]), bool(flip)


def epoch_boxes(loader, sizes: dict[int, tuple[int, int]]) -> dict[int, tuple[np.ndarray, bool]]:
    """Every sample's box and flip as delivered by `loader` over one epoch."""
    found = {}
    for batch in loader.host_batches():
        inputs, _ = loader.finish(batch)
        assert inputs.dtype == torch.uint8 and inputs.shape[1:] == (3, SIZE, SIZE)
        for k, index in enumerate(batch.indices.tolist()):
            found[index] = read_box(inputs[k].cpu(), *sizes[index])
    loader.close()
    return found


def settings_to_run():
    out = [("torch plain", "torch", {"variant": "plain", "num_workers": 1}),
           ("torch tuned", "torch", {"variant": "tuned", "num_workers": 1}),
           ("arrow encoded", "arrow", {"form": "encoded"}),
           ("arrow decoded", "arrow", {"form": "decoded"}),
           ("posix encoded", "posix", {"form": "encoded"}),
           ("posix decoded", "posix", {"form": "decoded"})]
    if backend_class("dali").available()[0]:
        out.append(("dali cpu", "dali", {"decoder": "cpu", "num_threads": 1}))
    return out


def test_every_backend_delivers_the_same_boxes_and_flips(folder, tmp_path):
    """One epoch of every backend: each sample's box, read from the pixels, is the shared plan's box on
    the source image within one stored pixel (1 source pixel where the JPEG is decoded, the frame's
    shrink factor for decoded frames), and every flip is the plan's."""
    cfg = gradient_config(folder, tmp_path)
    loader = make_loader(cfg, backend="torch", num_workers=0)
    sizes = {i: Image.open(io.BytesIO(loader.dataset.read(i))).size for i in range(len(loader.dataset))}
    plan = {i: transforms.plan(w, h, "train", SEED, 0, i) for i, (w, h) in sizes.items()}
    loader.close()
    report = {}
    for name, backend, settings in settings_to_run():
        got = epoch_boxes(make_loader(cfg, backend=backend, **settings), sizes)
        assert sorted(got) == sorted(plan), name  # every sample once
        stored = name.endswith("decoded")
        worst, worst_source, flips = 0.0, 0.0, 0
        for index, (box, flip) in got.items():
            width, height = sizes[index]
            kept = scaled_frame(width, height, MAX_SIDE) if stored else (width, height)
            pixel = max(width / kept[0], height / kept[1])  # one stored pixel, in source pixels
            deviation = np.abs(box - np.array(plan[index][0])).max()
            assert deviation <= pixel, f"{name}: sample {index} box {box.round(2)} vs the plan's {plan[index][0]}"
            worst, worst_source = max(worst, deviation / pixel), max(worst_source, deviation)
            flips += flip == plan[index][1]
        assert flips == len(plan), f"{name}: {flips} of {len(plan)} flips agree"
        report[name] = {"source_px": round(worst_source, 3), "stored_px": round(worst, 3),
                        "flips": f"{flips}/{len(plan)}"}
    print("max box deviation from the plan and flips agreeing, per backend:", json.dumps(report))
    assert {"torch plain", "arrow decoded", "posix decoded"} <= set(report)


def test_the_centre_form_is_detected_as_another_recipe(folder, tmp_path):
    """The control: the centre-square form under train augment delivers other boxes (the same read-back
    finds them off by far more than a pixel), and its recipe says so."""
    cfg = gradient_config(folder, tmp_path)
    loader = make_loader(cfg, backend="arrow", form="decoded", frame="centre")
    sizes = {i: Image.open(io.BytesIO(loader.dataset.read(i))).size for i in range(len(loader.dataset))}
    differences = recipe.differences(loader.recipe(), recipe.wanted(cfg.pipeline))
    assert differences and "crop" in differences[0]
    got = epoch_boxes(loader, sizes)
    off = [np.abs(box - np.array(transforms.plan(*sizes[i], "train", SEED, 0, i)[0])).max()
           for i, (box, _) in got.items()]
    assert np.median(off) > 10


def test_decoded_frames_equal_the_jpeg_path_where_the_frame_fits(folder, tmp_path):
    """Frames within max_side are stored at their own pixels: the decoded path's batches equal torch
    tuned's (same decoder, box and resize kernel)."""
    cfg = gradient_config(folder, tmp_path)
    cfg = cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(update={"max_side": 400})})
    tuned = [x for x, _ in make_loader(cfg, backend="torch", variant="tuned", num_workers=0)]
    for backend in ("arrow", "posix"):
        decoded = [x for x, _ in make_loader(cfg, backend=backend, form="decoded")]
        assert all(torch.equal(a, b) for a, b in zip(tuned, decoded, strict=True)), backend


def test_recipes_name_their_differences():
    cfg = config_from_dict({"pipeline": {"augment": "train", "max_side": 512}}, "x.yaml")
    want = recipe.wanted(cfg.pipeline)
    assert recipe.differences(recipe.delivered(cfg.pipeline), want) == []  # the JPEG paths
    assert recipe.differences(recipe.delivered(cfg.pipeline, "whole", 512), want) == []
    assert "max_side" in " ".join(recipe.differences(recipe.delivered(cfg.pipeline, "whole", 256), want))
    assert "crop" in " ".join(recipe.differences(recipe.delivered(cfg.pipeline, "centre", 256), want))
    evaluated = cfg.pipeline.model_copy(update={"augment": "eval"})
    assert recipe.differences(recipe.delivered(evaluated, "centre", 256), recipe.wanted(evaluated)) == []
    assert recipe.differences(recipe.delivered(evaluated, "centre", 288), recipe.wanted(evaluated))
    other = cfg.pipeline.model_copy(update={"image_size": 192})
    assert "image_size" in " ".join(recipe.differences(recipe.delivered(other), want))


def _run(label, backend, settings, rate, run_recipe):
    return {"backend": backend, "label": label, "settings": settings, "status": "ok", "recipe": run_recipe,
            "metrics": {"samples_per_s": {"median": rate}}}


def test_a_recipe_mismatch_keeps_auto_on_the_matching_path(folder, tmp_path, caplog):
    """A bench where the centre-square arrow form (another recipe under train) was fastest: the decision
    takes the fastest setting of the config's recipe, lists the other with its difference, and
    make_loader(backend="auto") builds the matching path; a decision that names the other recipe's
    setting directly (recorded by an older loadopt) is not followed."""
    cfg = gradient_config(folder, tmp_path)
    loader = make_loader(cfg, backend="torch", num_workers=0)
    dataset, pipeline = loader.dataset, cfg.pipeline
    loader.close()
    centre = {"form": "decoded", "frame": "centre"}
    whole = {"form": "decoded", "frame": "whole"}
    results = ResultsFile.model_validate_json(json.dumps({
        "created": "2026-11-30T00:00:00+00:00", "device": "cpu", "config_source": "gradients.yaml",
        "machine": decision.machine_info(), "config": {"pipeline": pipeline.model_dump(mode="json")},
        "dataset": {"fingerprint": dataset.fingerprint}, "recipe": recipe.wanted(pipeline),
        "runs": [_run("arrow centre", "arrow", centre, 9000.0, recipe.delivered(pipeline, "centre", 73)),
                 _run("arrow whole", "arrow", whole, 3000.0, recipe.delivered(pipeline, "whole", MAX_SIDE)),
                 _run("torch tuned", "torch", {"variant": "tuned", "num_workers": 0}, 800.0,
                      recipe.delivered(pipeline))],
        "ranking": ["arrow centre", "arrow whole", "torch tuned"]}))
    tier = decision.storage_tier(cfg.storage.tier, dataset.root)
    made = decision.make_decision(results, tier)
    assert made is not None and made.runner_up is not None
    assert made.label == "arrow whole" and made.runner_up.label == "torch tuned"
    assert [e.label for e in made.excluded] == ["arrow centre"]
    assert "crop" in made.excluded[0].differences[0]
    decision.record(made, None)
    chosen = make_loader(cfg)  # auto
    assert chosen.name == "arrow" and chosen.frame == "whole"
    assert recipe.differences(chosen.recipe(), recipe.wanted(pipeline)) == []
    chosen.close()

    stale = made.model_copy(update={"backend": "arrow", "settings": centre, "label": "arrow centre"})  # an older one
    decision.record(stale, None)
    caplog.set_level("WARNING", logger="loadopt.api")
    chosen = make_loader(cfg)
    assert chosen.recipe()["crop"] == recipe.TRAIN_CROP
    assert "not used" in caplog.text and "crop" in caplog.text
    chosen.close()

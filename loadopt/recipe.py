"""The training input a loader delivers (its recipe), and how two recipes differ.

A faster path is only an answer if it delivers the same training input. Every run records its
loader's recipe (`Loader.recipe()`); `results.json` records the config's (`wanted`). The decision and
`make_loader(backend="auto")` never pick a path whose recipe differs from the config's, and tables
name the difference. Fields:
- `crop`: the crop plan (RandomResizedCrop + flip on the whole frame for train, the 0.875 centre box for
  eval; a decoded centre square gives a plain random crop of that square instead: no border, no resize);
- `image_size`, `normalise` (dtype, mean, std); `transform`: the job's own per-sample transform, by name;
- `stored`: what the crop runs on: `source` (the JPEG, decoded every epoch; with `pipeline.jpeg_scale:
  reduced`, a crop at least twice the output decoded at a reduced DCT scale), `JPEG re-encoded <= N px
  qQ` (the encoded forms' bounded JPEGs, decoded every epoch: a source over `pipeline.max_side` re-encoded
  at that bound, as FFCV's jpg stores it; the others as they are), `whole frame <= N px` (the decoded
  frames, longer side bounded by `pipeline.max_side`), `centre N px square`;
- `max_side`: the bound of a stored whole frame (None: the source's own resolution);
- `order`: set (to the library's name) by a loader whose library orders the samples itself (the peers,
  dali `reader: native`): not the same samples in the same order as the sampler's, as DataLoader's would
  be. It differs from the config's unless `pipeline.order: any` (the wanted recipe's `order`) allows it.
Tokens: `kind: tokens` and `seq_len`. Records: `kind: records` (each record's first
`dataset.records.delivered_bytes` bytes, by every backend that reads them).
"""

from __future__ import annotations

from loadopt.errors import DatasetError
from loadopt.imaging.geometry import EVAL_CROP_FRACTION
from loadopt.schema.documents import Recipe

TRAIN_CROP = "RandomResizedCrop(scale 0.08-1, ratio 3/4-4/3) + flip"
EVAL_CROP = f"centre {EVAL_CROP_FRACTION:g} of the shorter side"
NO_CROP = "none (pipeline.transform crops)"
# must be equal; `max_side` is checked apart
COMPARED = ("kind", "crop", "image_size", "normalise", "seq_len", "transform")


class RecipeMismatch(DatasetError):
    """A loader setting that would deliver another training input than the config asks for."""


def check(loader, pipeline) -> None:
    """Raise `RecipeMismatch` naming the difference when `loader`'s recipe is not `pipeline`'s."""
    found = differences(loader.recipe(), wanted(pipeline, kind=loader.dataset.kind))
    if found:
        raise RecipeMismatch(f"{loader.name} ({loader.describe()}) delivers another training input than the config: "
                             + "; ".join(found))


def _base(pipeline, kind: str) -> Recipe:
    if kind == "tokens":
        return {"kind": "tokens", "seq_len": pipeline.seq_len}
    if kind == "records":
        return {"kind": "records"}
    normalise = "uint8" if pipeline.dtype == "uint8" else \
        f"float32 mean={tuple(pipeline.mean)} std={tuple(pipeline.std)}"
    recipe: Recipe = {"kind": "images", "image_size": pipeline.image_size, "normalise": normalise}
    if getattr(pipeline, "transform", None) is not None:  # the job's own: `auto` never moves a job across them
        recipe["transform"] = pipeline.transform + (" (image, target)" if pipeline.transform_target else "")
    return recipe


def crop_of(pipeline) -> str:
    """The crop plan `pipeline.augment` names."""
    return {"train": TRAIN_CROP, "eval": EVAL_CROP}.get(pipeline.augment, NO_CROP)


def wanted(pipeline, kind: str = "images") -> Recipe:
    """The recipe the config asks for (`kind`: the dataset's, images | tokens | records): for images the crop
    plan on the whole frame, at most `max_side` stored."""
    recipe = _base(pipeline, kind)
    recipe["order"] = getattr(pipeline, "order", "shared")  # `any`: a library's own order is allowed
    if kind == "images":
        recipe["crop"] = crop_of(pipeline)
        recipe["stored"], recipe["max_side"] = f"whole frame <= {pipeline.max_side} px", pipeline.max_side
    return recipe


def delivered(pipeline, frame: str | None = None, stored_size: int | None = None,
              kind: str = "images", reencoded_quality: int | None = None) -> Recipe:
    """What a loader delivers: `frame` None reads the source (JPEG) each epoch; `whole` decoded frames
    with the longer side at most `stored_size`, or with `reencoded_quality` JPEGs bounded by it (a larger
    source re-encoded at that quality); `centre` decoded `stored_size` squares."""
    recipe = _base(pipeline, kind)
    if kind != "images":
        return recipe
    if frame == "centre":
        if pipeline.augment == "train":
            crop = f"random {pipeline.image_size} px crop + flip of the square (no resize, no border)"
        else:
            crop = f"centre {pipeline.image_size / stored_size:.3g} of the shorter side"
            crop = EVAL_CROP if crop == f"centre {EVAL_CROP_FRACTION:.3g} of the shorter side" else crop
        return {**recipe, "crop": crop, "stored": f"centre {stored_size} px square", "max_side": stored_size}
    crop = crop_of(pipeline)
    if frame == "whole" and reencoded_quality is not None:
        return {**recipe, "crop": crop, "stored": f"JPEG re-encoded <= {stored_size} px q{reencoded_quality}",
                "max_side": stored_size}
    if frame == "whole":
        return {**recipe, "crop": crop, "stored": f"whole frame <= {stored_size} px", "max_side": stored_size}
    stored = "source" if getattr(pipeline, "jpeg_scale", "full") == "full" else \
        "source, a crop >= 2x the output decoded at 1/2-1/8 DCT scale"
    return {**recipe, "crop": crop, "stored": stored, "max_side": None}


def differences(run: Recipe | None, want: Recipe | None) -> list[str]:
    """What differs between a run's recipe and the wanted one, one phrase each ([] when they match;
    also when either is unknown, e.g. results written before recipes were recorded)."""
    if not run or not want:
        return []
    out = [f"{key} {run.get(key)!r}, the config's {want.get(key)!r}" for key in COMPARED
           if run.get(key) != want.get(key)]
    if run.get("order") not in (None, "shared") and want.get("order") != "any":
        out.append(f"order {run['order']}'s own, not the sampler's (pipeline.order: any allows it)")
    run_side, want_side = run.get("max_side"), want.get("max_side")
    if want.get("kind") == "images" and run_side is not None and want_side is not None \
            and run.get("stored", "").startswith(("whole", "JPEG re-encoded")) and run_side < want_side:
        out.append(f"stored frames <= {run_side} px, the config's max_side {want_side}")
    if run.get("stored", "").startswith("centre") and want.get("crop") == TRAIN_CROP and not out:
        out.append(f"stored {run['stored']}: the crops never see the frame's borders")
    return out


def describe(recipe: Recipe | None) -> str:
    """A short label: `RRC+flip 224 float32 / whole frame <= 512 px`."""
    if not recipe:
        return "?"
    if recipe.get("kind") == "tokens":
        return f"tokens seq_len={recipe.get('seq_len')}"
    if recipe.get("kind") == "records":
        return "records"
    crop = recipe.get("crop", "?")
    crop = "RRC+flip" if crop == TRAIN_CROP else "centre 0.875" if crop == EVAL_CROP else crop.split(" (")[0]
    order = f" / order={recipe['order']}" if recipe.get("order") not in (None, "shared", "any") else ""
    normalise = str(recipe.get("normalise", "?")).split()[0]
    transform = f" + {recipe['transform']}" if recipe.get("transform") else ""
    return f"{crop}{transform} {recipe.get('image_size')} {normalise} / {recipe.get('stored')}{order}"

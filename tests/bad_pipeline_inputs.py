"""Rows of the bad-input table for the job's own pipeline: a transform or factory named wrongly, a transform that
fails, `augment: none` without a transform, a field the dataset lacks."""

from __future__ import annotations

from .faults import Setup, images, write_config


def _setup(tmp_path, culprit: str, backend: str | None = "torch", dataset: dict | None = None, **sections) -> Setup:
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset=dataset or {"path": str(root)}, **sections)
    return Setup(["bench", str(config), "--loaders", "torch"], culprit, config=config, backend=backend,
                 leftovers=lambda: [p for p in [tmp_path / "results"] if p.exists()])


def transform_not_importable(tmp_path, cache):
    return _setup(tmp_path, "pipeline.transform: 'no_such_module:f': cannot import no_such_module",
                  pipeline={"transform": "no_such_module:f"})


def augment_none_without_a_transform(tmp_path, cache):
    return _setup(tmp_path, "augment: none leaves the crop to pipeline.transform, which is not set",
                  pipeline={"augment": "none"})


def factory_not_a_function(tmp_path, cache):
    return _setup(tmp_path, "dataset.factory: 'loadopt.version:__version__' is a str, not a function",
                  dataset={"factory": "loadopt.version:__version__"})


def factory_returning_no_dataset(tmp_path, cache):
    return _setup(tmp_path, "factory builtins:int: a int is not a dataset loadopt reads",
                  dataset={"factory": "builtins:int"})


def field_the_dataset_lacks(tmp_path, cache):
    return _setup(tmp_path, "has no field 'caption' (its fields: none besides the image and label)",
                  pipeline={"fields": ["caption"]})


def transform_that_raises(tmp_path, cache):
    # make_loader raises only once it iterates (tests/test_own_pipeline.py holds that line): the CLI's here
    return _setup(tmp_path, "pipeline.transform builtins:divmod raised TypeError: divmod expected 2 arguments, got 1 "
                  "(set dataset.on_error: skip to skip it)", backend=None, pipeline={"transform": "builtins:divmod"})


PIPELINE_CASES = {  # name: (setup, exit code)
    "pipeline.transform that does not import": (transform_not_importable, 2),
    "augment: none without pipeline.transform": (augment_none_without_a_transform, 2),
    "dataset.factory that is not a function": (factory_not_a_function, 2),
    "dataset.factory that returns no dataset": (factory_returning_no_dataset, 2),
    "pipeline.fields naming a field the dataset lacks": (field_the_dataset_lacks, 2),
    "pipeline.transform that raises on every sample": (transform_that_raises, 1),
}

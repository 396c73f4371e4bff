import pytest
import yaml

from loadopt.config import backend_settings, config_from_dict, load_config
from loadopt.errors import ConfigError

from .conftest import REPO


def write(tmp_path, data) -> str:
    path = tmp_path / "x.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def error_of(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert info.value.exit_code == 2
    return str(info.value)


def test_shipped_config_validates_and_sweeps():
    config = load_config(REPO / "configs" / "imagenet.yaml")
    assert config.pipeline.batch_size == 64
    points = backend_settings(config, "torch")
    assert {(p.variant, p.num_workers) for p in points} == {(v, w) for v in ("plain", "tuned") for w in (1, 2, 4)}


def test_wrong_type_names_file_and_key(tmp_path):
    path = write(tmp_path, {"workload": {"step_time_ms": "fast"}})
    assert error_of(path) == f"{path}: workload.step_time_ms: expected a number, got 'fast'"


def test_unknown_key(tmp_path):
    path = write(tmp_path, {"pipeline": {"batchsize": 3}})
    assert error_of(path) == f"{path}: pipeline.batchsize: unknown key"


def test_unknown_backend_and_backend_key(tmp_path):
    path = write(tmp_path, {"loaders": {"nonesuch": {}}})
    assert "loaders.nonesuch: unknown backend 'nonesuch'" in error_of(path)
    path = write(tmp_path, {"loaders": {"torch": {"workers": 2}}})
    assert error_of(path).startswith(f"{path}: loaders.torch.workers: unknown key (known: variant")


def test_sweep_element_error_names_index(tmp_path):
    path = write(tmp_path, {"loaders": {"torch": {"num_workers": [1, "many"]}}})
    assert error_of(path) == f"{path}: loaders.torch.num_workers[1]: expected an integer, got 'many'"


def test_missing_file_and_bad_yaml(tmp_path):
    assert error_of(str(tmp_path / "nope.yaml")) == f"{tmp_path / 'nope.yaml'}: config file not found"
    path = write(tmp_path, "pipeline: {batch_size: [1,\n")
    assert error_of(path).startswith(f"{path}: line ")
    assert "invalid YAML" in error_of(path)


def test_literal_error(tmp_path):
    path = write(tmp_path, {"storage": {"cache": "lukewarm"}})
    assert error_of(path) == f"{path}: storage.cache: expected one of 'warm' or 'cold', got 'lukewarm'"


def test_overrides_validate_and_name_the_override(tmp_path):
    path = write(tmp_path, {"name": "x"})
    config = load_config(path, ["workload.step_time_ms=40", "loaders.torch.num_workers=[0,3]"])
    assert config.workload.step_time_ms == 40
    assert [p.num_workers for p in backend_settings(config, "torch")] == [0, 3]
    message = error_of(path, ["workload.step_time_ms=fast"])
    assert message == f"{path} (--set workload.step_time_ms=fast): workload.step_time_ms: expected a number, got 'fast'"
    assert "expected KEY=VALUE" in error_of(path, ["workload.step_time_ms"])


def test_negative_values_rejected():
    with pytest.raises(ConfigError, match=r"pipeline.batch_size: input should be greater than 0, got -1"):
        config_from_dict({"pipeline": {"batch_size": -1}}, "cfg")

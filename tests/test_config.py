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


@pytest.mark.parametrize("text", ["", "\n# a comment, nothing else\n"])
def test_an_empty_config_file_is_an_error(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"empty\.yaml: the config file is empty"):
        load_config(path)


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


def test_accelerator_sets_the_step_time_from_the_published_table(tmp_path):
    # MLPerf Storage v1.0: resnet50 on h100, 0.224 s per batch of 400 -> 35.84 ms per batch of 64
    config = load_config(write(tmp_path, {"workload": {"accelerator": "h100"}, "pipeline": {"batch_size": 64}}))
    assert config.workload.step_time_ms == pytest.approx(35.84)
    assert config.workload.accelerator == "h100-resnet50"
    assert load_config(config, ["pipeline.batch_size=400"]).workload.step_time_ms == pytest.approx(224.0)
    assert config_from_dict(config.model_dump()).workload.step_time_ms == pytest.approx(35.84)  # a dump reloads
    unet = config_from_dict({"workload": {"accelerator": "a100-unet3d"}, "pipeline": {"batch_size": 7}})
    assert unet.workload.step_time_ms == pytest.approx(636.0)


def test_accelerator_errors(tmp_path):
    both = error_of(write(tmp_path, {"workload": {"accelerator": "a100", "step_time_ms": 40}}))
    assert "workload.step_time_ms" in both and "not both" in both and "\n" not in both
    unknown = error_of(write(tmp_path, {"workload": {"accelerator": "tpu9"}}))
    assert "workload.accelerator" in unknown and "tpu9" in unknown and "h100" in unknown


def test_storage_tier_accepts_local_profiles_and_inline_specs(tmp_path):
    assert load_config(write(tmp_path, {"storage": {"tier": "hdd"}})).storage.tier == "hdd"
    inline = {"bandwidth_mb_s": 100, "latency_ms": 2, "max_concurrency": 4, "error_rate": 0.01}
    assert load_config(write(tmp_path, {"storage": {"tier": inline}})).storage.tier == inline
    assert "unknown tier 'floppy'" in error_of(write(tmp_path, {"storage": {"tier": "floppy"}}))
    message = error_of(write(tmp_path, {"storage": {"tier": {"error_rate": 2}}}))
    assert "x.yaml: storage.tier.error_rate" in message
    assert "--set storage.tier=tape" in error_of(write(tmp_path, {}), ["storage.tier=tape"])
    assert "set one of them" in error_of(write(tmp_path, {"workload": {"accelerator": "h100", "model": "small_cnn"}}))


def test_a_real_model_step_needs_images():
    with pytest.raises(ConfigError, match=r"tokens\.yaml \(--set workload\.model=small_cnn\): workload\.model: "
                                          r"small_cnn is an image model; use none .* for tokens"):
        config_from_dict({"dataset": {"kind": "tokens"}}, "tokens.yaml", ["workload.model=small_cnn"])

"""cluster.yaml is a Ray cluster config `ray up` accepts: Ray's own preparation (the on-premise
provider's defaults), then its schema validation, as `ray up` does them."""

from pathlib import Path

import yaml

CLUSTER = Path(__file__).resolve().parents[1] / "cluster.yaml"


def test_cluster_yaml_validates_against_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CLUSTER.read_text())
    prepared = prepare_config(config)
    validate_config(prepared)  # raises on anything Ray's schema refuses
    assert prepared["provider"]["type"] == "local"
    assert len(prepared["provider"]["worker_ips"]) == 2
    # Each machine starts Ray with the custom resource that names its kind.
    commands = " ".join(prepared["setup_commands"] + prepared["head_setup_commands"])
    for kind in ("gbray_head", "gbray_cpu", "gbray_gpu"):
        assert kind in commands, kind
    for start in (prepared["head_start_ray_commands"], prepared["worker_start_ray_commands"]):
        assert any("--resources" in c for c in start)
    assert any("pip install" in c and "gbray" in c for c in prepared["setup_commands"])


def test_a_broken_cluster_yaml_is_refused(tmp_path):
    import jsonschema
    import pytest
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CLUSTER.read_text())
    config["head_start_ray_commands"] = "ray start --head"  # a string where Ray wants a list
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))

"""ray_cluster.yaml: valid against the schema inside the installed Ray wheel, accepted by the
launcher's own checks (`prepare_config` + `validate_config`), and secured as documented."""

import copy
import json
import os

import jsonschema
import pytest
import ray
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def config():
    with open(os.path.join(REPO, "ray_cluster.yaml")) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def schema():
    with open(os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")) as f:
        return json.load(f)


def test_matches_ray_schema(config, schema):
    jsonschema.validate(config, schema)


def test_launcher_checks(config):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    types = prepared["available_node_types"]
    assert prepared["head_node_type"] in types
    assert sum(t.get("min_workers", 0) for t in types.values()) <= prepared["max_workers"]
    for name, t in types.items():
        assert t.get("min_workers", 0) <= t.get("max_workers", prepared["max_workers"]), name


def test_launcher_rejects_what_the_test_claims_to_check(config):
    from ray.autoscaler._private.util import prepare_config, validate_config

    bad = copy.deepcopy(config)
    bad["head_node_type"] = "nope"
    with pytest.raises(ValueError, match="head_node_type"):
        validate_config(prepare_config(bad))
    bad = copy.deepcopy(config)
    bad["available_node_types"]["gpu_8x"]["bogus"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, json.load(open(os.path.join(os.path.dirname(ray.autoscaler.__file__),
                                                             "ray-schema.json"))))


def test_cpu_head_gpu_workers_secured(config):
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    workers = [t for n, t in types.items() if n != config["head_node_type"]]
    assert workers and all(t["resources"]["GPU"] == 8 for t in workers)
    assert any("[gpu]" in c and "pip install" in c for c in config["setup_commands"])
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in head_start
    for cmds in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        start = [c for c in cmds if "ray start" in c]
        assert start and all("RAY_AUTH_MODE=token ray start" in c for c in start)
    assert "~/.ray/auth_token" in config["file_mounts"]

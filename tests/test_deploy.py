"""``deploy/rayservice.yaml`` (KubeRay): valid against KubeRay's RayService v1 schema, and its
serveConfigV2 names genspec's application builder with arguments it accepts. (No cluster runs it here.)"""
from __future__ import annotations

import copy
import gzip
import importlib
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from genspec.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _manifest() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())


def _validator():
    schema = json.loads(gzip.open(Path(__file__).parent / "data" / "kuberay_rayservice_v1_schema.json.gz").read())
    return jsonschema.Draft7Validator(schema)


def test_the_manifest_is_a_valid_rayservice():
    manifest = _manifest()
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    _validator().validate(manifest)


def test_the_schema_check_catches_a_broken_manifest():
    broken = copy.deepcopy(_manifest())
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        _validator().validate(broken)


def test_every_pod_gets_the_api_key_from_a_secret():
    cluster = _manifest()["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        (env,) = [e for e in container["env"] if e["name"] == "GENSPEC_API_KEY"]
        assert env["valueFrom"]["secretKeyRef"]["name"] == "genspec-api-key"


def test_serve_config_names_the_application_builder_with_known_args(monkeypatch):
    monkeypatch.setenv("GENSPEC_API_KEY", "sk-from-the-secret")
    config = yaml.safe_load(_manifest()["spec"]["serveConfigV2"])
    (application,) = config["applications"]
    module, name = application["import_path"].split(":")
    builder = getattr(importlib.import_module(module), name)
    pytest.importorskip("ray")
    app = builder(application["args"])
    from ray.serve import Application

    assert isinstance(app, Application)
    with pytest.raises(ConfigError, match="unknown genspec application args"):
        builder({**application["args"], "modle": "/x"})
    # the builder takes the key from the environment; without one it refuses, unless told to serve anyone
    monkeypatch.delenv("GENSPEC_API_KEY")
    with pytest.raises(ConfigError, match="needs an API key in \\$GENSPEC_API_KEY"):
        builder(application["args"])
    assert isinstance(builder({**application["args"], "insecure_no_api_key": "true", "max_n": "2"}), Application)

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


def test_serve_config_names_the_application_builder_with_known_args():
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

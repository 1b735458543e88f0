"""A server's settings: one frozen ``ServerSettings``, checked when made, built alike from ``genspec serve``'s
flags and from a Ray Serve config's args."""
from __future__ import annotations

import dataclasses

import pytest

from genspec.cli import build_parser
from genspec.cli.serve import server_settings
from genspec.errors import ConfigError
from genspec.serve.security import ServeSecurity
from genspec.serve.settings import DEFAULT_MAX_BODY_BYTES, EMBEDDED_MODEL_NAME, ServerSettings


@pytest.mark.parametrize("bad, message", [
    ({"max_batch_size": 0}, "--max-batch-size must be >= 1"),
    ({"max_queue": -1}, "--max-queue and --grace-period >= 0"),
    ({"grace_s": -0.5}, "--max-queue and --grace-period >= 0"),
    ({"grace_s": float("nan")}, "--max-queue and --grace-period >= 0"),
    ({"max_body_bytes": 0}, "--max-body-bytes must be >= 1, got 0"),
    ({"chat_max_tokens": 0}, "chat_max_tokens must be >= 1"),
])
def test_bad_settings_are_refused_when_made(bad, message):
    with pytest.raises(ConfigError, match=message):
        ServerSettings(**bad)


def test_settings_are_frozen_and_name_the_model():
    settings = ServerSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_queue = 1
    assert settings.model_name == EMBEDDED_MODEL_NAME
    assert ServerSettings(model="/models/my-model").model_name == "my-model"
    assert ServerSettings(model="/models/my-model", served_model_name="x").model_name == "x"


def test_a_chat_without_max_tokens_gets_at_most_the_keys_limit():
    assert ServerSettings(chat_max_tokens=1024).default_max_tokens == 1024
    assert ServerSettings(chat_max_tokens=1024, security=ServeSecurity(max_tokens=100)).default_max_tokens == 100
    assert ServerSettings(chat_max_tokens=1024, security=ServeSecurity(max_tokens=0)).default_max_tokens == 1024


def test_genspec_serve_flags_build_the_settings():
    args = build_parser().parse_args([
        "serve", "--drafter", "ngram-cache", "-O", "namespace=a", "--extra-drafter", "suffix:max_nodes=8",
        "--extra-drafter", "none", "--max-batch-size", "2", "--max-queue", "3", "--grace-period", "1.5",
        "--max-body-bytes", "999", "--served-model-name", "mine", "--no-cost-measurement", "--max-n", "2",
        "--model-backend", "torch"])
    settings = server_settings(args)
    assert (settings.drafter, settings.drafter_options, settings.extra_drafters) == (
        "ngram-cache", {"namespace": "a"}, {"suffix": {"max_nodes": 8}, "none": {}})
    assert (settings.max_batch_size, settings.max_queue, settings.grace_s, settings.max_body_bytes) == (2, 3, 1.5, 999)
    assert (settings.model_name, settings.measure_costs, settings.model_backend) == ("mine", False, "torch")
    assert settings.security.max_n == 2
    defaults = server_settings(build_parser().parse_args(["serve", "--model-backend", "torch"]))
    assert defaults.max_body_bytes == DEFAULT_MAX_BODY_BYTES and defaults.max_queue == 64 and defaults.measure_costs


def test_a_ray_serve_config_builds_the_same_settings(monkeypatch):
    """``app_builder``'s string args become the settings every replica and the router get (Ray not started)."""
    import genspec.serve.ray_backend as ray_backend

    monkeypatch.setenv("GENSPEC_API_KEY", "sk-test")
    monkeypatch.setattr(ray_backend, "deployment", lambda settings, *rest, **options: settings)
    settings = ray_backend.app_builder({"model": "/models/m", "max_queue": "3", "grace_period": "2", "max_n": "2",
                                        "max_body_bytes": "999", "measure_costs": "false"})
    assert isinstance(settings, ServerSettings)
    assert (settings.model, settings.max_queue, settings.grace_s, settings.max_body_bytes) == ("/models/m", 3, 2.0, 999)
    assert settings.security.max_n == 2 and len(settings.security.api_key_sha256) == 1 and not settings.measure_costs
    assert settings.model_name == EMBEDDED_MODEL_NAME  # a config file names its model with served_model_name
    with pytest.raises(ConfigError, match="--max-queue and --grace-period >= 0"):
        ray_backend.app_builder({"max_queue": "-1"})

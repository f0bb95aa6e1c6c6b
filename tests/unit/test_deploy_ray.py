"""The shipped Ray Serve config and KubeRay RayService are valid and build the real application.

Pins: deploy/ray/serve.yaml and the RayService's serveConfigV2 validate against Serve's own
config schema; their import path builds the AgentReplica deployment with the owner-pinned
router (and, when autoscaling, the calls/GPU policy) from their args, with a health check that
gives a slow replica 30 s before it counts as failed; the GPU workers run on
the node's network, one pod per node, with a GPU each and the node's address for ICE; the head,
where Serve's controller runs, gets the proxy check limits `serve --ray` sets for its own Ray.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

try:
    from ray.serve.schema import ServeDeploySchema

    from agent.serve.app import POLICY_PATH, PROXY_CHECK_TIMEOUTS, ROUTER_PATH, app_builder
except ImportError:  # pragma: no cover - depends on the environment
    if os.environ.get("CI") == "true":
        raise  # the `test` extra pins ray[serve]: missing is a failure in CI
    pytest.skip("ray[serve] is not installed (pip install '.[serve]')", allow_module_level=True)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _rayservice() -> dict:
    # The file also holds the model cache's PersistentVolumeClaim (tests/unit/test_deploy_image.py).
    docs = yaml.safe_load_all((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    (service,) = [d for d in docs if d and d.get("kind") == "RayService"]
    return service


def _serve_configs() -> list[dict]:
    return [
        yaml.safe_load((DEPLOY / "ray" / "serve.yaml").read_text()),
        yaml.safe_load(_rayservice()["spec"]["serveConfigV2"]),
    ]


@pytest.mark.parametrize("index", [0, 1], ids=["serve.yaml", "rayservice"])
def test_serve_configs_validate_and_build_the_agent(index: int) -> None:
    config = _serve_configs()[index]
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "agent.serve.app:app_builder"
    built = app_builder(app["args"])
    deployment = built._bound_deployment
    assert deployment.name == "agent"
    dconf = deployment._deployment_config
    assert dconf.request_router_config.request_router_class == ROUTER_PATH
    assert dconf.graceful_shutdown_timeout_s == app["args"]["graceful_shutdown_s"]
    # A slow check is no death: a loaded replica keeps its calls (a dead one is known at once).
    assert dconf.health_check_timeout_s >= 30
    gpus = deployment.ray_actor_options.get("num_gpus", 0)
    assert gpus == (1 if app["args"].get("device") == "cuda" else 0)  # a whole GPU per replica on CUDA
    if app["args"].get("autoscale"):
        policy = dconf.autoscaling_config.policy
        assert policy.policy_function == POLICY_PATH
        assert policy.policy_kwargs["target_calls_per_replica"] == app["args"]["target_calls_per_replica"]
        assert dconf.autoscaling_config.min_replicas == app["args"]["replicas"]
    else:
        # The count is a `deployments:` override, which Serve changes in place (no new version).
        (override,) = app["deployments"]
        assert override["name"] == deployment.name and override["num_replicas"] >= 1
        assert "replicas" not in app["args"]


def test_unknown_args_are_refused() -> None:
    with pytest.raises(ValueError, match="max_sesions"):
        app_builder({"max_sesions": 3})


def test_gpu_workers_use_the_node_network_one_per_node() -> None:
    spec = _rayservice()["spec"]["rayClusterConfig"]
    (gpu,) = spec["workerGroupSpecs"]
    pod = gpu["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    (rule,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    assert rule["labelSelector"]["matchLabels"] == gpu["template"]["metadata"]["labels"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e for e in container["env"]}
    assert env["OMNI_AGENT_ICE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    grace = pod["terminationGracePeriodSeconds"]
    args = yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert grace > args["graceful_shutdown_s"]  # Kubernetes must not kill a draining replica first
    assert spec["rayVersion"] == "2.60.0"


def test_the_head_gets_the_proxy_check_limits_serve_ray_sets() -> None:
    spec = _rayservice()["spec"]["rayClusterConfig"]
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert PROXY_CHECK_TIMEOUTS and {k: env.get(k) for k in PROXY_CHECK_TIMEOUTS} == PROXY_CHECK_TIMEOUTS


def test_ice_servers_in_a_serve_config_are_parsed_as_the_flag_is() -> None:
    """`ice_servers` in a Serve config's args takes the --ice-server form; a bare TURN URL gets its
    per-call credentials from `turn_secret` (a bad entry is refused when the app is built)."""
    built = app_builder(
        {
            "ice_servers": ["stun:stun.example.com:3478", "turn:turn.example.com:3478?transport=udp"],
            "turn_secret": "s3cret",
            "cors_origins": ["https://example.com"],
        }
    )
    config = built._bound_deployment.init_args[0]
    assert [s.url for s in config.ice_servers] == [
        "stun:stun.example.com:3478",
        "turn:turn.example.com:3478?transport=udp",
    ]
    assert config.cors_origins == ("https://example.com",)
    with pytest.raises(ValueError):
        app_builder({"ice_servers": ["http://not-ice"]})

"""`spirit serve --ray`'s options, checked before Ray starts, and plain `spirit serve` never
importing Ray. Runs with or without the `ray` extra."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spirit.cli import build_parser, main
from spirit.server.config import ServerConfig
from spirit.server.ray_serve import RayOptions, app_builder, ray_options


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray", "--replicas", "0"], "--replicas must be >= 1"),
    (["--ray", "--replicas", "2", "--max-replicas", "3"], "not both"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "must be >= --min-replicas"),
    (["--ray", "--min-replicas", "0"], "--min-replicas must be >= 1"),
    (["--ray", "--cpus-per-replica", "0"], "--cpus-per-replica must be > 0"),
    (["--ray", "--max-context", "0"], "--max-context must be >= 1"),
])
def test_bad_ray_options_end_in_one_line(argv, message, capsys):
    assert main(["serve", "--method", "vanilla", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spirit: error:") and message in err and "Traceback" not in err


def test_options_become_ray_serves_deployment_options():
    args = build_parser().parse_args(["serve", "--ray", "--min-replicas", "1", "--max-replicas", "4",
                                      "--cpus-per-replica", "0.5"])
    options = ray_options(args)
    assert options.threads == 1 and options.autoscaling
    deployment = options.deployment_options(ServerConfig(max_queue=6, max_batch=2))
    assert deployment["max_ongoing_requests"] == 8  # the scheduler's own capacity: running + waiting
    assert deployment["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2}
    assert deployment["ray_actor_options"]["num_cpus"] == 0.5
    fixed = RayOptions(replicas=3, cpus_per_replica=2.5).deployment_options(ServerConfig())
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert ray_options(build_parser().parse_args(["serve"])) is None


def test_the_serve_run_builder_refuses_unknown_and_missing_keys():
    with pytest.raises(ValueError, match="unknown option 'replica'"):
        app_builder({"model": "smollm2-135m", "replica": "2"})
    with pytest.raises(ValueError, match="model= is required"):
        app_builder({"replicas": "2"})
    with pytest.raises(ValueError, match="is not an int"):
        app_builder({"model": "m", "replicas": "two"})


def test_plain_serve_never_imports_ray():
    code = """
import sys
from spirit.cli import main
from spirit.server import ServerThread, ServerConfig
from spirit.testing import tiny_spirit
import httpx
assert main(["serve", "--method", "vanilla", "--port", "70000"]) == 2  # the whole command path up to the model
with ServerThread(tiny_spirit("llama", num_layers=2), ServerConfig(method="vanilla")) as srv:
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
assert not loaded, loaded
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

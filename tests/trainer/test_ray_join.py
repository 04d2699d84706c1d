"""Joining a Ray cluster at placement.ray_address (trainer/ray_session.py): Ray 2.60's `ray start --head` turns
token authentication on; the trainer uses a token at hand, and a refusal says which cause and which fix."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from mindspeed_rl.trainer.ray_session import auth_token_source, join_error, pids_on_node

# the message Ray raises (ray/_private/utils.py check_version_info) when the versions differ
VERSION_MISMATCH = ("Version mismatch: The cluster was started with:\n    Ray: 2.59.0\n    Python: 3.11.7\n"
                    "This process on node 10.0.0.2 was started with:\n    Ray: 2.60.0\n    Python: 3.11.7\n")


def test_the_token_comes_from_where_ray_reads_it(tmp_path, monkeypatch):
    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert auth_token_source() is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 32)
    assert auth_token_source() == str(tmp_path / ".ray" / "auth_token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    assert auth_token_source() is None   # the path Ray is told to read holds no token
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 32)
    assert auth_token_source() == "RAY_AUTH_TOKEN"


def test_the_driver_cleans_up_after_the_workers_of_its_own_node_only():
    info = {("rollout", 0): {"pid": 11, "node_id": "head"}, ("actor", 0): {"pid": 12, "node_id": "head"},
            ("actor", 1): {"pid": 11, "node_id": "other"}, ("rule", 0): {"node_id": "head"}}
    assert pids_on_node(info, "head") == [11, 12]   # pid 11 of the other node is another process here
    assert pids_on_node(info, None) == [11, 12, 11]


def test_each_cause_gets_its_own_line_and_fix():
    version = join_error("10.0.0.1:6379", RuntimeError(VERSION_MISMATCH), None)
    assert "another Ray or Python" in version and "Ray: 2.59.0" in version and "install the cluster's" in version
    refused = ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")
    no_token = join_error("10.0.0.1:6379", refused, None)
    assert "no Ray authentication token" in no_token and "ray get-auth-token" in no_token
    wrong = join_error("10.0.0.1:6379", refused, "RAY_AUTH_TOKEN")
    assert "with the authentication token from RAY_AUTH_TOKEN" in wrong
    assert all("\n" not in m for m in (version, no_token, wrong))


JOIN = textwrap.dedent("""
    import sys
    from mindspeed_rl.config import ConfigError, config_from_dict
    from mindspeed_rl.planning import make_plan
    from mindspeed_rl.trainer.ray_session import RaySession
    cfg = config_from_dict({"trainer": {"output_dir": sys.argv[2]}, "placement": {"ray_address": sys.argv[1]}})
    session = RaySession()
    try:
        session.start(cfg, make_plan(cfg, check_files=False))
    except ConfigError as e:
        print("REFUSED", e)
        sys.exit(2)
    import ray
    print("JOINED", ray.cluster_resources().get("CPU"))
    ray.shutdown()
""")


@pytest.mark.slow
@pytest.mark.slow_budget(60, reason="starts a Ray head (`ray start --head`, about 8 s), then joins it twice: once "
                                    "refused after Ray's 20 s of retries, once accepted")
def test_a_head_started_by_ray_start_is_joined_with_its_token_and_refused_without(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head_home, empty_home = tmp_path / "head_home", tmp_path / "empty_home"
    head_home.mkdir()
    empty_home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    (head_home / ".ray").mkdir()
    (head_home / ".ray" / "auth_token").write_text("5" * 64)   # the head's token, as `ray get-auth-token` gives
    ray_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")   # short: Ray's Unix sockets live under it
    head = subprocess.Popen(["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=4",
                             "--include-dashboard=false", f"--temp-dir={ray_dir}"],
                            env={**env, "HOME": str(head_home), "RAY_TMPDIR": ray_dir}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not start"
                time.sleep(0.5)
        time.sleep(2)   # the GCS listens before the head's raylet has registered

        def join(home):
            return subprocess.run([sys.executable, "-c", JOIN, address, str(tmp_path / "out")],
                                  env={**env, "HOME": str(home)}, capture_output=True, text=True, timeout=120)
        refused = join(empty_home)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "REFUSED placement.ray_address='127.0.0.1:" in refused.stdout
        assert "no Ray authentication token" in refused.stdout
        joined = join(head_home)   # RAY_AUTH_MODE unset: the token at ~/.ray/auth_token turns it on
        assert joined.returncode == 0 and "JOINED 4.0" in joined.stdout, joined.stdout + joined.stderr
    finally:
        os.killpg(head.pid, signal.SIGTERM)   # `ray start --block` stops what it started
        head.wait(timeout=60)
        shutil.rmtree(ray_dir, ignore_errors=True)

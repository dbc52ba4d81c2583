"""keras-perf on real distributed engines, each scenario in fresh processes (tests/_dist_worker.py).

- TensorFlow: MirroredStrategy over two logical CPU devices; MultiWorkerMirroredStrategy with
  two worker processes on 127.0.0.1 (ports picked at run time).
- JAX: keras.distribution.DataParallel over two host devices (XLA_FLAGS).

Each scenario runs once per CI run (under the matching backend's pass of the suite).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "_dist_worker.py")
TIMEOUT = 420


def _env(backend: str, **extra: str) -> dict:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    env.update(extra)
    return env


def _result(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"worker printed no RESULT line:\n{stdout[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def _run(scenario: str, env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, WORKER, scenario],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _result(proc.stdout)


@pytest.fixture(scope="module")
def mirrored():
    return _run("tf_mirrored", _env("tensorflow"))


@pytest.fixture(scope="module")
def jax_dp():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    return _run("jax_dp", _env("jax", XLA_FLAGS=flags.strip()))


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def mwms():
    """Two MultiWorkerMirroredStrategy workers; both are killed whatever happens."""
    workers = [f"127.0.0.1:{p}" for p in _free_ports(2)]
    procs = []
    try:
        for index in range(2):
            tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, "tf_mwms"],
                    env=_env("tensorflow", TF_CONFIG=json.dumps(tf_config)),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == 0, err[-4000:]
            results.append(_result(out))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# --- MirroredStrategy (two logical CPUs) ---------------------------------------------------


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("k", [1, 2])
def test_mirrored_train_step_matches_one_device(mirrored, k):
    assert mirrored["replicas"] == 2
    assert mirrored[f"train_step_mb{k}"] < 1e-5


@pytest.mark.backends("tensorflow")
def test_mirrored_overflow_skips_step_on_every_replica(mirrored):
    # One poisoned example on the last replica's shard: the global gradient is not finite,
    # so every replica skips (weights bit-identical) and the scale halves once.
    o = mirrored["overflow"]
    assert o["skipped"] == 1
    assert o["unchanged"] == 0.0
    assert o["scale_after_overflow"] == 2.0**14
    assert o["skipped_after_clean_step"] == 0
    assert o["moved_after_clean_step"] > 1e-4


# --- MultiWorkerMirroredStrategy (two processes) -------------------------------------------


@pytest.mark.backends("tensorflow")
def test_multi_worker_train_step_matches_one_device(mwms):
    assert sorted(r["task"] for r in mwms) == [0, 1]
    for r in mwms:
        assert r["replicas"] == 2
        assert r["train_step_mb2"] < 1e-5


# --- JAX DataParallel (two host devices) ----------------------------------------------------


@pytest.mark.backends("jax")
@pytest.mark.parametrize("k", [1, 2])
def test_jax_data_parallel_train_step_matches_one_device(jax_dp, k):
    assert jax_dp["replicas"] == 2
    assert jax_dp[f"train_step_mb{k}"] < 1e-5


# --- Pieces under each engine -----------------------------------------------------------


@pytest.mark.backends("tensorflow")
def test_mirrored_pruning_masks_identical_on_replicas(mirrored):
    p = mirrored["pruning"]
    assert p["replicas_agree"] is True
    assert p["sparsity"] == [0.5, 0.5]


@pytest.mark.backends("tensorflow")
def test_multi_worker_pruning_same_masks_on_both_workers(mwms):
    assert mwms[0]["pruning"]["sparsity"] == [0.5, 0.5]
    assert mwms[0]["pruning"]["mask_hash"] == mwms[1]["pruning"]["mask_hash"]


@pytest.mark.backends("tensorflow")
def test_multi_worker_stopping_decisions_agree(mwms):
    # Worker 1 sleeps 2 s per epoch, so its own clock would stop it first; TimeLimit ORs the
    # decision over workers (a collective) so both stop after the same epoch and none hangs.
    a, b = mwms[0]["stopping"], mwms[1]["stopping"]
    assert a["early"] == b["early"] == [0, 0, "threshold"]
    assert a["time_limit"] == b["time_limit"]
    assert a["time_limit"][1] == "time_limit" and a["time_limit"][2] < 50


@pytest.mark.backends("jax")
def test_jax_data_parallel_pruning(jax_dp):
    assert jax_dp["pruning"]["sparsity"] == [0.5, 0.5]


@pytest.mark.backends("tensorflow")
def test_mirrored_monitor_counts_global_examples(mirrored):
    # 64 examples, global batch 16 over 2 replicas: 64 examples and 4 steps, not 32 per replica.
    assert mirrored["monitor"] == {"examples": [64, 64], "steps": [4, 4]}


@pytest.mark.backends("tensorflow")
def test_multi_worker_monitor_counts_global_examples(mwms):
    for r in mwms:
        assert r["monitor"] == {"examples": [64, 64], "steps": [4, 4]}


@pytest.mark.backends("jax")
def test_jax_data_parallel_monitor(jax_dp):
    assert jax_dp["monitor"] == {"examples": [64, 64], "steps": [4, 4]}


@pytest.mark.backends("tensorflow")
def test_mirrored_distillation_matches_one_device(mirrored):
    assert mirrored["distill"]["student"] < 1e-5
    assert mirrored["distill"]["teacher_unchanged"] == 0.0


@pytest.mark.backends("jax")
def test_jax_data_parallel_distillation_matches_one_device(jax_dp):
    assert jax_dp["distill"]["student"] < 1e-5
    assert jax_dp["distill"]["teacher_unchanged"] == 0.0


@pytest.mark.backends("tensorflow")
def test_multi_worker_distillation_matches_one_device(mwms):
    for r in mwms:
        assert r["distill"]["student"] < 1e-5
        assert r["distill"]["teacher_unchanged"] == 0.0

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

# Every scenario starts fresh processes with their own devices (minutes on 2 cores): the slow
# tier.
pytestmark = pytest.mark.slow

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


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("k", [1, 2])
def test_mirrored_skipped_step_keeps_batchnorm_statistics_on_every_replica(mirrored, k):
    # One Inf on the last replica's shard: every replica skips, and every replica's copy of
    # every variable (BatchNormalization's moving statistics too) stays exactly as it was.
    case = mirrored[f"batchnorm_skip_mb{k}"]
    assert case["skipped"] == 1
    assert case["change"] == 0.0


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


# --- fit_with_oom_retry -------------------------------------------------------------------


def _check_oom_recovery(o, event):
    assert o["raised"] == 1
    assert o["epochs"] == [0, 1]  # every epoch once
    assert o["events"] == [event]  # [epoch, batch_size, micro-batches that failed]
    assert o["error"].startswith(("ResourceExhaustedError", "JaxRuntimeError"))
    assert o["microbatches"] == 2
    # The rolled-back updates are not counted: same optimizer steps as the reference.
    assert o["iterations"][0] == o["iterations"][1]
    assert o["weights"] < 1e-5
    assert o["loss"] < 1e-5
    assert o["replicas_agree"] is True


@pytest.mark.backends("tensorflow")
def test_mirrored_oom_on_one_replica_recovers_both(mirrored):
    # Replica 1 alone runs out of memory at epoch 1, step 2 (per-replica batch 8). Both
    # replicas roll back to the start of epoch 1 and re-run it with 2 micro-batches; the
    # weights match one device that used 2 micro-batches from epoch 1 on.
    o = mirrored["oom"]
    _check_oom_recovery(o, [1, 16, 1])
    assert o["iterations"][0] == 8
    # The retry ran on the replicas, in slices of 4 (the twin kept the strategy): 4 steps x 2.
    assert o["sizes_after"] == [4] * 8


@pytest.mark.backends("jax")
def test_jax_data_parallel_oom_recovers(jax_dp):
    # One SPMD program for both devices: the OOM fails the whole step (raised while jax.jit
    # traces the short last batch of epoch 0, after 4 updates), and the epoch re-runs.
    o = jax_dp["oom"]
    _check_oom_recovery(o, [0, 16, 1])
    assert o["iterations"][0] == 10  # 5 steps x 2 epochs
    assert o["sizes_after"] == [8, 4]  # the retry traced slices of the 16- and 8-batches


@pytest.mark.backends("tensorflow")
def test_multi_worker_oom_retry_refused_clearly(mwms):
    # An OOM on one worker cannot reach the others (they would wait in their collective), so
    # fit_with_oom_retry refuses to start, on both workers, in scope or not.
    for r in mwms:
        o = r["oom_refused"]
        for where in ("in_scope", "model_only"):
            kind, message = o[where]
            assert kind == "RuntimeError"
            assert "MultiWorkerMirroredStrategy" in message and "model.fit" in message
        assert o["unchanged"] == 0.0


# --- EarlyStopping / TimeLimit under JAX DataParallel -------------------------------------


@pytest.mark.backends("jax")
def test_jax_data_parallel_stopping(jax_dp):
    s = jax_dp["stopping"]
    assert s["early"] == [0, 0, "threshold"]
    stopped, reason, epochs_run = s["time_limit"]
    assert reason == "time_limit" and epochs_run == stopped + 1 < 50


@pytest.mark.backends("jax")
def test_jax_data_parallel_early_stopping_same_as_one_device(jax_dp):
    e = jax_dp["early_stopping"]
    # val_loss is lowest at epoch 9; patience=2 stops after epoch 11, on both.
    assert e["one_device"] == e["distributed"] == [11, 9, "patience", 12]
    assert e["val_loss"] < 1e-5
    assert e["weights"] < 1e-5  # the restored best weights

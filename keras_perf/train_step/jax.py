"""JAX train step of `kp.LossScaleTrainStep` (hook contract: `TrainStepBase` in
keras_perf/train_step/_base.py).

Stateless, like Keras' own: `train_step(state, data) -> (logs, state)`. Shapes are static in
JAX, so the slicing is decided in Python: equal slices run under `jax.lax.scan` (one slice's
activations alive at a time, one traced copy of the model) and a shorter remainder slice, if
any, runs once after it.

Known cost on a CPU: inside the scan body XLA:CPU leaves the kernel-gradient convolutions in
a non-canonical layout and runs them as naive loops, so micro-batching a convolutional model
is about 6x slower per step there (docs/BENCHMARKS.md, runs 5 and 6). It is XLA's, not this
step's: the same CNN written in bare JAX with its slices in `lax.scan` is as slow
(benchmarks/_floors.py `raw_cnn_step`), and jax-ml/jax#12868 ("Convolution is significantly
slower inside a loop body (CPU)", open since 2022) reports the same slowdown. Unrolling the slices is
fast but lets XLA keep several slices' activations alive (optimization barriers are dropped on
CPU, and data dependencies between slices kept only 1.35x of the 3.9x saving), so the scan
stays.
"""

from __future__ import annotations

import jax
import keras
from keras import ops

from keras_perf._utils import first_tensor, map_batch, metric_results_deferred, training_step
from keras_perf.train_step._base import TrainStepBase


def _index(variables, target):
    for i, v in enumerate(variables):
        if v is target:
            return i
    raise ValueError(f"variable {target.path} not found")


class TrainStep(TrainStepBase):
    """JAX `train_step(state, data)`; the base of `kp.LossScaleTrainStep` on JAX."""

    def train_step(self, state, data):
        with training_step():
            return self._kp_train_step(state, data)

    def _kp_slice_grads(
        self, trainable, non_trainable, metrics_vars, optimizer_vars, x, y, sw, whole=None
    ):
        """Gradients of one slice; returns (grads, non_trainable, metrics_vars).

        `whole` is (batch size, sample weights) of the batch this slice was cut from, or None
        for an uncut batch (the stock loss).
        """
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        args = (trainable, non_trainable, metrics_vars, x, y, sw)
        # The forward pass runs (is traced) inside grad_fn: remat applies there.
        if whole is None:
            with self._kp_remat():
                (_, aux), grads = grad_fn(*args, training=True, optimizer_variables=optimizer_vars)
            ctx = None
        else:
            with self._kp_slice(whole[0], int(first_tensor(x).shape[0]), whole[1]) as ctx:
                with self._kp_remat():
                    (_, aux), grads = grad_fn(
                        *args, training=True, optimizer_variables=optimizer_vars
                    )
        unscaled_loss, y_pred, non_trainable, metrics_vars = aux
        mapping = list(zip(self.metrics_variables, metrics_vars))
        # Keras' scope for running stateful Keras code on explicit state values (what Keras'
        # own JAX trainer uses; public as keras.StatelessScope since Keras 3.0).
        with keras.StatelessScope(state_mapping=mapping) as scope, metric_results_deferred():
            # Keras' _update_metrics_variables, with the slice's loss tracked so that the
            # slices add up to the whole batch's entry; results read once, at the end.
            self._kp_track_loss(unscaled_loss, ctx, first_tensor(x).shape[0])
            self.compute_metrics(x, y, y_pred, sw)
        metrics_vars = [
            scope.get_current_value(v) if scope.get_current_value(v) is not None else value
            for v, value in mapping
        ]
        return grads, non_trainable, metrics_vars

    def _kp_train_step(self, state, data):
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        before, metrics_before = non_trainable, metrics_vars
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        batch = int(first_tensor(x).shape[0])
        size, count = self._kp_slice_size(batch)
        full = batch // size  # slices of exactly `size`
        rest = batch - full * size

        if self.microbatches == 1:
            grads, non_trainable, metrics_vars = self._kp_slice_grads(
                trainable, non_trainable, metrics_vars, optimizer_vars, x, y, sw
            )
        else:
            self._kp_check_microbatching(data)
            whole = (batch, sw)

            def split(t):
                return t[: full * size].reshape((full, size) + t.shape[1:])

            slices = map_batch(split, (x, y, sw))

            def body(carry, sl):
                acc, ntv, mv = carry
                g, ntv, mv = self._kp_slice_grads(trainable, ntv, mv, optimizer_vars, *sl, whole)
                return (jax.tree_util.tree_map(jax.numpy.add, acc, g), ntv, mv), None

            zeros = jax.tree_util.tree_map(jax.numpy.zeros_like, trainable)
            (grads, non_trainable, metrics_vars), _ = jax.lax.scan(
                body, (zeros, non_trainable, metrics_vars), slices
            )
            if rest:
                tail = map_batch(lambda t: t[full * size :], (x, y, sw))
                g, non_trainable, metrics_vars = self._kp_slice_grads(
                    trainable, non_trainable, metrics_vars, optimizer_vars, *tail, whole
                )
                grads = jax.tree_util.tree_map(jax.numpy.add, grads, g)

        lso = self.loss_scale_optimizer
        scale_index = (
            _index(self.optimizer.variables, lso.dynamic_scale) if lso is not None else None
        )
        scale = optimizer_vars[scale_index] if lso is not None else None
        grads, finite, norm = self._kp_process_gradients(grads, scale)
        # A skipped step keeps no forward-pass update either (every slice's): the old values
        # where the gradients are not finite. A variable the forward pass left alone comes
        # back as the same traced value and needs no select (XLA would drop it anyway).
        non_trainable = [
            jax.numpy.where(finite, new, old) if restore and new is not old else new
            for new, old, restore in zip(non_trainable, before, self._kp_restored_on_skip())
        ]
        # Nor is its loss or metric value tracked (grad_norm and skipped_steps count it below).
        metrics_vars = [
            jax.numpy.where(finite, new, old) if restore and new is not old else new
            for new, old, restore in zip(
                metrics_vars, metrics_before, self._kp_metrics_restored_on_skip()
            )
        ]
        if lso is not None:
            trainable, optimizer_vars = self.optimizer.stateless_apply(
                optimizer_vars, grads, trainable
            )
        else:
            old = (trainable, optimizer_vars)
            trainable, optimizer_vars = ops.cond(
                finite,
                lambda: tuple(self.optimizer.stateless_apply(optimizer_vars, grads, trainable)),
                lambda: old,
            )

        mapping = list(zip(self.metrics_variables, metrics_vars))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self._kp_update_step_metrics(norm, finite)
            logs = self.get_metrics_result()
        metrics_vars = [
            scope.get_current_value(v) if scope.get_current_value(v) is not None else value
            for v, value in mapping
        ]
        # No loss scaling (bfloat16, float32): the scale is 1, logged so code reading it works.
        logs["loss_scale"] = optimizer_vars[scale_index] if lso is not None else ops.ones(())
        return logs, (trainable, non_trainable, optimizer_vars, metrics_vars)

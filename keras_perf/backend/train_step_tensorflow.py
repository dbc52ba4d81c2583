"""TensorFlow train step of `kp.LossScaleTrainStep` (see keras_perf/train_step.py).

Micro-batching runs as a `tf.while_loop` inside the compiled step: batch sizes are dynamic in
TensorFlow graphs, and the loop keeps one slice's activations alive at a time. The first slice
is traced outside the loop, which tells which variables receive no gradient (None), exactly as
the stock step leaves them out of the update.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf
from keras import ops

# Private import: Keras divides the loss by the replica count under tf.distribute and tracks
# the undivided value; this is its helper for that (checked on Keras 3.8-3.15).
from keras.src.losses.loss import unscale_loss_for_distribution

from keras_perf._utils import first_tensor, map_batch


class TrainStep:
    """TensorFlow `train_step(data)`; mixed into `kp.LossScaleTrainStep`."""

    def _kp_slice_loss(self, x, y, sample_weight, weight):
        """Forward one slice; returns (scaled weighted loss, y_pred) and updates the loss tracker."""
        y_pred = self(x, training=True) if self._call_has_training_arg else self(x)
        loss = self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        self._loss_tracker.update_state(
            unscale_loss_for_distribution(loss), sample_weight=tf.shape(first_tensor(x))[0]
        )
        scaled = loss * tf.cast(weight, loss.dtype)
        if self.optimizer is not None:
            scaled = self.optimizer.scale_loss(scaled)
        return scaled, y_pred

    def _kp_slice_grads(self, x, y, sample_weight, weight):
        with tf.GradientTape() as tape:
            scaled, y_pred = self._kp_slice_loss(x, y, sample_weight, weight)
        # Read after the forward pass: a subclassed model creates its weights on first call.
        variables = self.trainable_weights
        grads = tape.gradient(scaled, variables) if variables else []
        self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return grads, variables

    def train_step(self, data):
        self._kp_in_train_step = True
        try:
            return self._kp_train_step(data)
        finally:
            self._kp_in_train_step = False

    def _kp_train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        batch = tf.shape(first_tensor(x))[0]
        size, count = self._kp_slice_size(batch)
        batch_f = tf.cast(batch, "float32")

        def slice_weight(start):
            stop = tf.minimum(start + size, batch)
            return stop, tf.cast(stop - start, "float32") / batch_f

        # The first slice (the whole batch when microbatches == 1).
        stop, weight = slice_weight(0)
        if self.microbatches == 1:
            grads, variables = self._kp_slice_grads(x, y, sample_weight, 1.0)
        else:
            first = map_batch(lambda t: t[:stop], (x, y, sample_weight))
            grads, variables = self._kp_slice_grads(*first, weight)
        connected = [i for i, g in enumerate(grads) if g is not None]

        if self.microbatches > 1:

            def body(i, acc):
                start = i * size
                stop, weight = slice_weight(start)
                sl = map_batch(lambda t: t[start:stop], (x, y, sample_weight))
                g, _ = self._kp_slice_grads(*sl, weight)
                return i + 1, [a + g[j] for a, j in zip(acc, connected)]

            _, acc = tf.while_loop(
                lambda i, _: i < count, body, (tf.constant(1, count.dtype), [grads[j] for j in connected])
            )
            grads = [None] * len(grads)
            for j, a in zip(connected, acc):
                grads[j] = a

        if not variables:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
        else:
            lso = self.loss_scale_optimizer
            if lso is not None and not lso.built:
                # Without a tf.distribute strategy Keras builds the optimizer while the step
                # is first traced (TensorFlow then traces again with the variables in place).
                with keras.name_scope(lso.name, caller=lso):
                    lso.build(variables)
            scale = lso.dynamic_scale if lso is not None else None
            grads, finite, norm = self._kp_process_gradients(grads, scale)
            pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
            grads, applied = [g for g, _ in pairs], [v for _, v in pairs]
            if lso is not None:
                # LossScaleOptimizer skips non-finite steps and updates its scale itself.
                self.optimizer.apply(grads, applied)
            else:
                _apply_if_finite(self.optimizer, finite, grads, applied)
            self._kp_update_step_metrics(norm, finite)

        logs = self.get_metrics_result()
        if self.loss_scale_optimizer is not None:
            logs["loss_scale"] = tf.identity(self.loss_scale_optimizer.dynamic_scale)
        return logs


def _apply_if_finite(optimizer, finite, grads, variables):
    """`optimizer.apply` when `finite`, else nothing; also inside a tf.distribute strategy.

    Under a strategy that needs `merge_call` (e.g. MirroredStrategy), `apply` synchronises
    replicas, which cannot happen inside a replica-context `cond`; the cond then runs in the
    cross-replica context, as Keras' `LossScaleOptimizer._tf_apply` does.
    """
    if not tf.distribute.has_strategy() or tf.__internal__.distribute.strategy_supports_no_merge_call():
        ops.cond(finite, lambda: optimizer.apply(grads, variables), lambda: None)
        return

    def cross_replica(distribution, finite, grads, variables):
        # As Keras' LossScaleOptimizer does: the first replica's decision applies to all.
        finite = distribution.experimental_local_results(finite)[0]

        def apply_fn():
            distribution.extended.call_for_each_replica(optimizer.apply, args=(grads, variables))

        ops.cond(finite, apply_fn, lambda: None)

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(finite, grads, variables))

"""TensorFlow train step of `kp.LossScaleTrainStep` (hook contract: `TrainStepBase` in
keras_perf/train_step/_base.py).

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

from keras_perf import _keras_internals as keras_internals
from keras_perf._utils import first_tensor, map_batch, metric_results_deferred, training_step
from keras_perf.backend.tensorflow import is_multi_worker
from keras_perf.train_step._base import TrainStepBase


def _all_reduce(grads):
    """Sum the gradients over the replicas of a tf.distribute strategy.

    Every replica then sees the global gradient, so the finiteness test, the norm and the
    clipping agree on all replicas (Keras' LossScaleOptimizer tests each replica's own
    gradients and keeps the first replica's verdict). Returns (grads, number of replicas).
    """
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return grads, 1
    ctx = tf.distribute.get_replica_context()
    replicas = ctx.num_replicas_in_sync
    present = [g for g in grads if g is not None]
    if replicas == 1 or not present:
        return grads, replicas
    reduced = iter(ctx.all_reduce(tf.distribute.ReduceOp.SUM, present))
    return [None if g is None else next(reduced) for g in grads], replicas


def _apply_if_finite(optimizer, finite, grads, variables):
    """`optimizer.apply` only when `finite`, also under strategies that need a merge call."""
    if (
        not tf.distribute.has_strategy()
        or tf.__internal__.distribute.strategy_supports_no_merge_call()
    ):
        ops.cond(finite, lambda: optimizer.apply(grads, variables), lambda: None)
        return

    def cross_replica(distribution, finite, grads):
        # A cond whose branch reaches the optimizer's merge call must run in cross-replica
        # context; `finite` is the same on every replica (global gradient), take the first.
        first = distribution.experimental_local_results(finite)[0]

        def apply():
            distribution.extended.call_for_each_replica(optimizer.apply, args=(grads, variables))

        ops.cond(first, apply, lambda: None)

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(finite, grads))


def _coalesce(grads):
    """Sparse gradients (IndexedSlices) replaced by their rows with duplicates summed.

    Returns (gradients, {position: original IndexedSlices}). The segment sum runs over the
    rows looked up, not a vocabulary-sized dense tensor, and lets the norm and the finiteness
    test see the true gradient.
    """
    sparse, out = {}, list(grads)
    for j, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            unique, position = tf.unique(g.indices)
            out[j] = tf.math.unsorted_segment_sum(g.values, position, tf.shape(unique)[0])
            sparse[j] = g
    return out, sparse


def _saved_before_forward(model):
    """(variable, value) for each non-trainable and metric variable a skipped step restores.

    A read is no copy: TensorFlow keeps the old buffer only while an assignment replaces it.
    Under a tf.distribute strategy each replica reads (and restores) its own copy.
    """
    variables = [
        *zip(model.non_trainable_variables, model._kp_restored_on_skip()),
        *zip(model.metrics_variables, model._kp_metrics_restored_on_skip()),
    ]
    return [(v, tf.identity(v.value)) for v, restore in variables if restore]


def _restore_if_skipped(finite, saved):
    """Assign the saved values back when `finite` is false."""
    if not saved:
        return
    if (
        not tf.distribute.has_strategy()
        or tf.__internal__.distribute.strategy_supports_no_merge_call()
    ):

        def restore():
            for v, value in saved:
                v.assign(value)

        ops.cond(finite, lambda: None, restore)
        return
    # An assignment in replica context may need a merge call, which must not sit in a cond
    # branch: select instead (the variables written in a forward pass are small ones).
    for v, value in saved:
        v.assign(tf.where(finite, v.value, value))


class TrainStep(TrainStepBase):
    """TensorFlow `train_step(data)`; the base of `kp.LossScaleTrainStep` on TensorFlow."""

    _kp_scale_for_distribution = staticmethod(keras_internals.scale_loss_for_distribution)

    @staticmethod
    def _kp_sum_of_squares(tensors):
        # tf.nn.l2_loss (sum of squares / 2) is one fused kernel per tensor. The generic dot
        # product is a 1 x n by n x 1 MatMul in TensorFlow, and the grad norm cost about 8 %
        # of a 784-1024-1024-10 MLP step on 2 CPU cores that way; this costs about 1-3 %.
        return 2.0 * tf.add_n([tf.nn.l2_loss(tf.cast(t, "float32")) for t in tensors])

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras (3.8-3.15) builds a model under a strategy from one distributed batch reduced
        # with `strategy.reduce("MEAN", (x, y))`; MultiWorkerMirroredStrategy cannot reduce a
        # tuple and stock `fit` fails there. Any one replica's shard has the right structure
        # and dtypes for the symbolic build, so take the first local one instead.
        if self._distribute_strategy is not None and iterator is not None and data_batch is None:
            strategy = self.distribute_strategy

            def local(value):
                if isinstance(value, tf.distribute.DistributedValues):
                    return strategy.experimental_local_results(value)[0]
                return value

            for _, _, it in iterator:
                data_batch = tf.nest.map_structure(local, next(it))
                break
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _kp_build_compile_loss(self, y, y_pred, sample_weight):
        # Without a tf.distribute strategy Keras builds the compiled loss on its first call,
        # inside the traced step; build it symbolically (no graph ops, no metric updates) so
        # that its terms can be read before the first slice's loss is computed.
        compile_loss = keras_internals.compiled_loss(self)
        if compile_loss.built:
            return

        def spec(t):
            return keras.KerasTensor(t.shape, keras.backend.standardize_dtype(t.dtype))

        keras_internals.compute_output_spec(
            compile_loss, *map_batch(spec, (y, y_pred, sample_weight))
        )

    def _kp_slice_loss(self, x, y, sample_weight, ctx):
        """Forward one slice; returns (scaled loss, y_pred) and updates the loss tracker.

        With `ctx` (a cut batch), the loss is the slice's exact share of the full-batch loss
        (see `TrainStepBase._compute_loss`); without, the stock loss of the whole batch.
        """
        with self._kp_remat():
            y_pred = self(x, training=True) if self._call_has_training_arg else self(x)
        loss = self._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        unscaled = keras_internals.unscale_loss_for_distribution(loss)
        self._kp_track_loss(unscaled, ctx, tf.shape(first_tensor(x))[0])
        scaled = self.optimizer.scale_loss(loss) if self.optimizer is not None else loss
        return scaled, y_pred

    def _kp_slice_grads(self, x, y, sample_weight, batch=None, full_sample_weight=None):
        with tf.GradientTape() as tape:
            if batch is None:
                scaled, y_pred = self._kp_slice_loss(x, y, sample_weight, None)
            else:
                size = tf.shape(first_tensor(x))[0]
                with self._kp_slice(batch, size, full_sample_weight) as ctx:
                    scaled, y_pred = self._kp_slice_loss(x, y, sample_weight, ctx)
        # Read after the forward pass: a subclassed model creates its weights on first call.
        variables = self.trainable_weights
        grads = tape.gradient(scaled, variables) if variables else []
        with metric_results_deferred():  # read once, at the end of the step
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return grads, variables

    def _kp_accumulate(self, x, y, sample_weight):
        """Gradients of the whole batch, accumulated over its slices in a `tf.while_loop`."""
        batch = tf.shape(first_tensor(x))[0]
        size, count = self._kp_slice_size(batch)

        def cut(start):
            stop = tf.minimum(start + size, batch)
            return map_batch(lambda t: t[start:stop], (x, y, sample_weight))

        # The first slice, traced outside the loop: it tells which variables get no gradient
        # (None) and which get sparse ones (IndexedSlices, from Embedding lookups).
        grads, variables = self._kp_slice_grads(*cut(0), batch, sample_weight)
        connected = [i for i, g in enumerate(grads) if g is not None]
        sparse = [i for i in connected if isinstance(grads[i], tf.IndexedSlices)]
        dense = [i for i in connected if i not in sparse]

        def rows(i, arrays, g):
            # Sparse gradients are accumulated by concatenating their rows (values, indices),
            # never densified: memory grows with the rows looked up, not with the vocabulary.
            return [
                (v.write(i, g[j].values), r.write(i, g[j].indices))
                for (v, r), j in zip(arrays, sparse)
            ]

        def body(i, acc, arrays):
            g, _ = self._kp_slice_grads(*cut(i * size), batch, sample_weight)
            return i + 1, [a + g[j] for a, j in zip(acc, dense)], rows(i, arrays, g)

        arrays = [
            (
                tf.TensorArray(grads[j].values.dtype, size=count, infer_shape=False),
                tf.TensorArray(grads[j].indices.dtype, size=count, infer_shape=False),
            )
            for j in sparse
        ]
        arrays = rows(0, arrays, grads)
        # One slice at a time. The slices do not depend on each other, so TensorFlow's
        # executor would otherwise overlap them: up to 10 loop iterations at once by default,
        # and the first iteration with the first slice, whose gradients only the first
        # accumulation waits for. Each overlap keeps one more slice's activations.
        first = [grads[j] for j in dense] + [a.flow for pair in arrays for a in pair]
        with tf.control_dependencies(first):
            first_index = tf.identity(tf.constant(1, count.dtype))
        _, acc, arrays = tf.while_loop(
            lambda i, *_: i < count,
            body,
            (first_index, [grads[j] for j in dense], arrays),
            parallel_iterations=1,
        )
        out = [None] * len(grads)
        for j, a in zip(dense, acc):
            out[j] = a
        for j, (v, r) in zip(sparse, arrays):
            out[j] = tf.IndexedSlices(v.concat(), r.concat(), grads[j].dense_shape)
        return out, variables

    def train_step(self, data):
        with training_step():
            return self._kp_train_step(data)

    def _kp_train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        saved = _saved_before_forward(self)
        if self.microbatches == 1:
            grads, variables = self._kp_slice_grads(x, y, sample_weight)
        else:
            self._kp_check_microbatching(data)
            grads, variables = self._kp_accumulate(x, y, sample_weight)

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
            grads, replicas = _all_reduce(grads)
            grads, sparse = _coalesce(grads)
            grads, finite, norm = self._kp_process_gradients(grads, scale)
            # The optimizer gets the sparse gradients' rows as the full batch has them (not
            # coalesced: Keras' sparse optimizer updates, e.g. Adam's, depend on the rows),
            # clipped by the factor that _kp_process_gradients applied to the dense ones.
            factor = 1.0
            if self.clipnorm is not None:
                factor = self.clipnorm / tf.maximum(norm, self.clipnorm)
            for j, g in sparse.items():
                grads[j] = tf.IndexedSlices(
                    g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape
                )
            if replicas > 1:
                # The optimizer sums the replicas' gradients again: hand it 1/N of the sum.
                grads = [
                    None
                    if g is None
                    else tf.IndexedSlices(g.values / replicas, g.indices, g.dense_shape)
                    if isinstance(g, tf.IndexedSlices)
                    else g / replicas
                    for g in grads
                ]
            pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
            grads, applied = [g for g, _ in pairs], [v for _, v in pairs]
            if lso is not None:
                # LossScaleOptimizer skips non-finite steps and updates its scale itself.
                self.optimizer.apply(grads, applied)
            else:
                _apply_if_finite(self.optimizer, finite, grads, applied)
            self._kp_update_step_metrics(norm, finite)
            # Nor does a skipped step keep any forward-pass update (of every slice).
            _restore_if_skipped(finite, saved)

        logs = self.get_metrics_result()
        if self.loss_scale_optimizer is not None:
            logs["loss_scale"] = tf.identity(self.loss_scale_optimizer.dynamic_scale)
        else:  # no loss scaling (bfloat16, float32): the scale is 1, logged all the same
            logs["loss_scale"] = tf.ones(())
        if is_multi_worker(self):
            # Keras reduces each log with strategy.reduce("MEAN", v, axis=0) under
            # MultiWorkerMirroredStrategy, which needs a leading axis: give each value one.
            logs = {k: tf.reshape(v, [1]) for k, v in logs.items()}
        return logs

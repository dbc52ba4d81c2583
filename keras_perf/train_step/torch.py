"""PyTorch train step of `kp.LossScaleTrainStep` (hook contract: `TrainStepBase` in
keras_perf/train_step/_base.py).

PyTorch runs eagerly, so slices are a Python loop and `backward()` accumulates each slice's
gradient into `.grad`, as gradient accumulation is written by hand in PyTorch.
"""

from __future__ import annotations

import contextlib
import warnings

import keras
import torch

from keras_perf._utils import first_tensor, map_batch, metric_results_deferred, training_step
from keras_perf.train_step import torch_traced
from keras_perf.train_step._base import TrainStepBase


class TrainStep(TrainStepBase):
    """PyTorch `train_step(data)`; the base of `kp.LossScaleTrainStep` on PyTorch."""

    @staticmethod
    def _kp_sum_of_squares(tensors):
        # torch directly: each keras.ops call costs tens of microseconds of Python on eager
        # torch (the generic version makes three per tensor). The pass over the gradients
        # itself stays: about 3 % of a 784-1024-1024-10 MLP step on 2 CPU cores.
        flat = [
            t.reshape(-1) if t.dtype == torch.float32 else t.reshape(-1).float() for t in tensors
        ]
        return torch.stack([torch.vdot(t, t) for t in flat]).sum()

    @staticmethod
    def _kp_all_finite(sum_sq, tensors):
        # Eager, so a Python branch: a Keras `ops.cond` builds an `Operation` and inspects a
        # signature on every call here (about 0.3 ms per step under cProfile). On a GPU,
        # reading the flag is a host synchronisation; the step makes that one anyway right
        # after, to decide whether to apply (see the mixin).
        if bool(torch.isfinite(sum_sq)):
            return torch.ones((), dtype=torch.bool, device=sum_sq.device)
        return torch.stack([torch.isfinite(t).all() for t in tensors]).all()

    def _kp_update_step_metrics(self, norm, finite):
        """`_utils.update_step_metrics` in place on the trackers' tensors.

        The same sums as the Keras metrics' `update_state` (Mean: total += norm, count += 1
        on finite steps; Sum: total += 1 on skipped ones), without their per-op Python:
        about 17 instead of 90 microseconds per eager step.
        """
        mean, skipped = self.grad_norm_tracker, self.skipped_steps_tracker
        mean.total.value.add_(torch.where(finite, norm, torch.zeros_like(norm)))
        mean.count.value.add_(finite.to(mean.count.value.dtype))
        skipped.total.value.add_((~finite).to(skipped.total.value.dtype))

    def _kp_snapshot(self):
        """What a skipped step restores: (variable, version, saved value) per restored
        non-trainable and metric variable.

        Eager, so the values must be copied before the forward pass writes them in place.
        Only the variables a forward pass has written before (told by torch's version
        counter) are copied, so frozen weights (non-trainable too) cost nothing per step; on
        the first step every one is copied once.
        """
        written = getattr(self, "_kp_written", None)
        snapshot = []
        for v, restore in zip(self.non_trainable_variables, self._kp_restored_on_skip()):
            if restore:
                t = v.value
                saved = t.detach().clone() if written is None or id(v) in written else None
                snapshot.append((v, t._version, saved))
        # Metric state (a few scalars each, written every step): always copied.
        for v, restore in zip(self.metrics_variables, self._kp_metrics_restored_on_skip()):
            if restore:
                snapshot.append((v, v.value._version, v.value.detach().clone()))
        return snapshot

    def _kp_restore_if_skipped(self, snapshot, finite):
        """Put back the snapshot's variables the step wrote, unless `finite` (no host sync)."""
        written = set(getattr(self, "_kp_written", None) or ())
        for v, version, saved in snapshot:
            t = v.value
            if t._version != version:
                written.add(id(v))
                if saved is not None:
                    t.copy_(torch.where(finite, t, saved))
        self._kp_written = frozenset(written)

    def make_train_function(self, force=False):
        traced = self.__dict__.get("_kp_traced_step")
        if traced is not None:
            traced.lists_key = None  # the variables are read again at this fit's first step
        return super().make_train_function(force)

    def train_step(self, data):
        if self._traced_step is not False and "train_step" not in self.__dict__:
            # `traced_step=True`: the step as one traced graph (torch_traced.py), unless the
            # model fell back (the traced step then calls this step again, which runs below).
            traced = torch_traced.traced_step_for(self, inductor=self._traced_step == "inductor")
            if traced.reason is None:
                return traced(data)
        return self._kp_eager_step(data)

    def _kp_eager_step(self, data):
        """keras-perf's step run eagerly (what the traced step runs for data it cannot trace)."""
        with training_step():
            return self._kp_train_step(data)

    def _kp_train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        variables = self.trainable_weights[:]
        batch = int(first_tensor(x).shape[0])
        size, count = self._kp_slice_size(batch)
        if self.microbatches > 1:
            self._kp_check_microbatching(data)
        self.zero_grad()
        snapshot = self._kp_snapshot()
        for i in range(count):
            start, stop = i * size, min((i + 1) * size, batch)
            if self.microbatches == 1:
                xs, ys, sws = x, y, sample_weight
                ctx = contextlib.nullcontext()
            else:
                xs, ys, sws = map_batch(lambda t, a=start, b=stop: t[a:b], (x, y, sample_weight))
                ctx = self._kp_slice(batch, stop - start, sample_weight)
            with ctx as sl:
                with self._kp_remat():
                    y_pred = self(xs, training=True) if self._call_has_training_arg else self(xs)
                loss = self._compute_loss(
                    x=xs, y=ys, y_pred=y_pred, sample_weight=sws, training=True
                )
                # With a slice, the loss is its exact share of the full-batch loss.
                self._kp_track_loss(loss, sl, batch)
            scaled = self.optimizer.scale_loss(loss) if self.optimizer is not None else loss
            if variables:
                scaled.backward()
            with metric_results_deferred():  # read once, at the end of the step
                self.compute_metrics(xs, ys, y_pred, sample_weight=sws)

        if variables:
            grads = [v.value.grad for v in variables]
            lso = self.loss_scale_optimizer
            with torch.no_grad():
                grads, finite, norm = self._kp_process_gradients(
                    grads, lso.dynamic_scale if lso is not None else None
                )
                if lso is not None:
                    self.optimizer.apply(grads, variables)
                elif bool(finite):  # the one host sync of this path (see the mixin's docstring)
                    self.optimizer.apply(grads, variables)
                self._kp_update_step_metrics(norm, finite)
                self._kp_restore_if_skipped(snapshot, finite)
        else:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)

        logs = self.get_metrics_result()
        if self.loss_scale_optimizer is not None:
            logs["loss_scale"] = self.loss_scale_optimizer.dynamic_scale.value.detach().clone()
        else:  # no loss scaling (bfloat16, float32): the scale is 1, logged all the same
            logs["loss_scale"] = keras.ops.ones(())
        return logs

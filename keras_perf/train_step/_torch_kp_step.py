"""keras-perf's own train step (`kp.LossScaleTrainStep`) inside the traced torch step.

`torch_traced` traces a step into aten graphs; what keras-perf's step adds after the
gradients lives here: their norm, clipping and finiteness (`_kp_gradients`), the update with
the non-finite skip (`_kp_update`), and on a CPU the step as two graphs with the skip decided
on the host between them (`_SplitStep`).
"""

from __future__ import annotations

import functools

import keras

if keras.backend.backend() != "torch":  # imported by torch_traced only
    raise ImportError(
        "keras_perf.train_step._torch_kp_step is part of keras-perf's traced train step for the "
        f"PyTorch backend; Keras runs on {keras.backend.backend()}."
    )

import torch  # noqa: E402

from keras_perf._utils import metric_results_deferred, training_step  # noqa: E402


class _SplitStep:
    """keras-perf's traced step on a CPU, as two graphs with one check between them.

    The one-graph step keeps a skipped step's variables by computing the update into copies
    and selecting with `torch.where`, so the host never waits for the gradients (what a GPU
    needs). On a CPU there is nothing to wait for, and those copies and selections cost a
    third of an MLP's step (1.30x the plain traced step in float32, 1.50x in bfloat16: every
    weight and Adam slot read and written three more times). So here the first graph runs the
    forward and backward passes and the gradients' clipping, norm and finiteness (of their
    sum of squares, each gradient's only where that is not finite, as the eager step), writing
    nothing; then `bool(finite)` picks the update graph, in place as Keras' own step, or the
    skip graph (traced at the first skipped step), as keras-perf's eager step does.
    """

    def __init__(self, traced, forward, spec, n_flat):
        self.traced, self.forward, self.spec, self.n_flat = traced, forward, spec, n_flat
        self.gradients = self.update = self.skip = None
        self.present, self.written, self.pred_spec = [], [], None
        self.keys = {}

    def gradients_step(self, *args):
        """Forward, backward, clip: `[finite, norm, *gradients, *forward writes, *y_pred]`."""
        model = self.traced.model
        grads, after_fwd, state, _x, _y, y_pred, _sw = self.forward(*args)
        with torch.no_grad():
            grads, finite, norm = _kp_gradients(model, grads, per_tensor=False)
        self.present[:] = [g is not None for g in grads]
        self.written[:] = [i for i, (a, s) in enumerate(zip(after_fwd, state)) if a is not s]
        pred, self.pred_spec = torch.utils._pytree.tree_flatten(_detached(y_pred))
        return [
            finite,
            norm,
            *(g for g in grads if g is not None),
            *(after_fwd[i] for i in self.written),
            *pred,
        ]

    def update_step(self, finite_known, *args):
        """The optimizer's update (or, `finite_known` False, the skip), the metrics, the
        writes into the variables' tensors; returns the logs' values."""
        traced = self.traced
        model, variables = traced.model, traced.variables
        n_vars, n_tv = len(variables), len(model.trainable_variables)
        state = list(args[:n_vars])
        rest = list(args[n_vars:])
        tensors, rest = rest[: self.n_flat], rest[self.n_flat :]
        finite, norm, rest = rest[0], rest[1], rest[2:]
        n_grads = sum(self.present)
        grads_in, rest = iter(rest[:n_grads]), rest[n_grads:]
        writes, pred = rest[: len(self.written)], rest[len(self.written) :]
        grads = [next(grads_in) if p else None for p in self.present]
        after_fwd = list(state)
        for i, value in zip(self.written, writes):
            after_fwd[i] = value
        data = torch.utils._pytree.tree_unflatten(tensors, self.spec)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = torch.utils._pytree.tree_unflatten(pred, self.pred_spec)
        new, logs = _kp_update(model, variables, state, after_fwd, grads, n_tv,
                               (x, y, y_pred, sample_weight), finite, norm,
                               finite_known=finite_known)  # fmt: skip
        for target, value in zip(state, new):
            if value is not target:
                target.copy_(value)
        self.keys[finite_known] = tuple(logs)
        return [logs[k] for k in self.keys[finite_known]]

    def run(self, values, flat):
        """The gradients graph run; then the graph that finishes the step, its log keys and
        the first graph's outputs (its inputs beside the variables' tensors and the batch)."""
        outs = list(self.gradients(*values, *flat))
        finite = bool(outs[0])  # on a CPU the values are there: no device to wait for
        if not finite:  # the sum of squares overflowed, or a gradient is not finite
            # The gradients are clipped already: a factor of 0 or more keeps finite values
            # finite, and a non-finite factor comes only from a non-finite gradient.
            grads = outs[2 : 2 + sum(self.present)]
            outs[0] = torch.stack([torch.isfinite(g).all() for g in grads]).all()
            finite = bool(outs[0])
        graph = self.update if finite else self.skip
        if graph is None:
            graph = self.traced._graph(
                functools.partial(self.update_step, finite), values, [*flat, *outs]
            )
            if finite:
                self.update = graph
            else:
                self.skip = graph
        return graph, self.keys[finite], outs


def _detached(y_pred):
    """`y_pred` (a tensor, or a dict or list of them: multi-output models) detached."""
    return keras.tree.map_structure(lambda t: t.detach(), y_pred)


def _kp_gradients(model, grads, per_tensor=True):
    """keras-perf's step's gradients: `(clipped gradients, finite, norm)` (norm before
    clipping, as the eager step logs it). `per_tensor=False`: `finite` is the sum of
    squares' finiteness alone, which a non-finite gradient always makes False; the host then
    checks each gradient where it is False, as the eager step does (`_kp_all_finite`)."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads, torch.ones((), dtype=torch.bool), torch.zeros(())
    sum_sq = model._kp_sum_of_squares(present)
    if per_tensor:
        finite = torch.stack([torch.isfinite(g).all() for g in present]).all()
    else:
        finite = torch.isfinite(sum_sq)
    norm = torch.sqrt(sum_sq)
    if model.clipnorm is not None:
        clip = torch.tensor(model.clipnorm, dtype=torch.float32)
        factor = clip / torch.maximum(norm, clip)
        grads = [None if g is None else g * factor.to(g.dtype) for g in grads]
    return grads, finite, norm


def _kp_update(model, variables, state, after_fwd, grads, n_tv, batch, finite=None, norm=None,
               finite_known=None):  # fmt: skip
    """keras-perf's step (microbatches=1, no loss scaling) after the gradients: clip (unless
    `finite` is given: the gradients are clipped already), skip when not finite, step metrics
    and logs. With `finite_known` None the skip is selected with `torch.where` (no host
    synchronisation); True or False: the step is known finite, or known skipped."""
    x, y, y_pred, sample_weight = batch
    tv = variables[:n_tv]
    if finite is None:
        grads, finite, norm = _kp_gradients(model, grads)
    opt_vars = {id(v) for v in model.optimizer.variables}
    if finite_known is False:  # the skip: nothing of the update is kept
        applied = list(after_fwd)
    else:
        # The optimizer writes in place: a step that may be skipped gives it copies, so the
        # old values stay for `torch.where` to pick.
        work = [t.clone() if finite_known is None and (i < n_tv or id(v) in opt_vars) else t
                for i, (v, t) in enumerate(zip(variables, after_fwd))]  # fmt: skip
        with keras.StatelessScope(state_mapping=list(zip(variables, work))) as upd:
            model.optimizer.apply(list(grads), tv)
        applied = [upd.get_current_value(v) for v in variables]
        applied = [w if a is None else a for w, a in zip(work, applied)]
    restore_ntv = dict(zip(map(id, model.non_trainable_variables), model._kp_restored_on_skip()))
    restore_metric = dict(
        zip(map(id, model.metrics_variables), model._kp_metrics_restored_on_skip())
    )
    new = []
    for v, old, fwd, app in zip(variables, state, after_fwd, applied):
        if id(v) in opt_vars or any(v is t for t in tv):
            keep = {None: None, True: app, False: old}[finite_known]
            new.append(torch.where(finite, app, old) if keep is None else keep)
        elif restore_ntv.get(id(v)) or restore_metric.get(id(v)):
            keep = {None: None, True: fwd, False: old}[finite_known]
            if keep is None:
                keep = fwd if fwd is old else torch.where(finite, fwd, old)
            new.append(keep)
        else:
            new.append(fwd)
    # The compiled metrics take the batch unless the step is skipped, as in the eager step
    # (whose snapshot puts them back); with the skip unknown, the old values are selected.
    with training_step():
        if finite_known is not False:
            with keras.StatelessScope(state_mapping=list(zip(variables, new))) as met:
                with metric_results_deferred():
                    model.compute_metrics(x, y, _detached(y_pred), sample_weight)
            counted = [met.get_current_value(v) for v in variables]
            new = [n if c is None else c for n, c in zip(new, counted)]
            if finite_known is None:
                new = [torch.where(finite, n, old) if restore_metric.get(id(v)) else n
                       for v, n, old in zip(variables, new, state)]  # fmt: skip
        # grad_norm and skipped_steps count every step, skipped or not; then the logs.
        with keras.StatelessScope(state_mapping=list(zip(variables, new))) as met:
            model._kp_update_step_metrics(norm, finite)
            logs = model.get_metrics_result()
    final = [met.get_current_value(v) for v in variables]
    final = [n if f is None else f for n, f in zip(new, final)]
    logs = dict(logs)
    logs["loss_scale"] = torch.ones(())
    return final, logs

"""keras-perf's traced train step on the PyTorch backend (`install_traced_step`).

Keras' torch step runs every layer's Python on every batch (about 1.3 ms of a 1.8 ms MLP step
on this project's CPU, /work/shared/FACTS.md). This module traces the whole step once per
input signature (the shapes and dtypes of the batch: the short last batch is a second trace)
into one aten graph with `torch.fx.experimental.proxy_tensor.make_fx` under fake tensors:

- the forward pass as Keras' own step runs it (`model(x, training=True)` inside a
  `keras.StatelessScope` that maps every variable to a graph input), the loss through the
  model's `_compute_loss` (losses added in `call()` and regularisers included, as Keras' JAX
  trainer collects them), the loss tracker and `compute_metrics`;
- the gradients (`torch.autograd.grad` while tracing records the backward aten ops, so the
  graph is forward and backward jointly and runs without autograd);
- Keras' own optimizer `apply` (its learning-rate schedule, iterations, weight decay, EMA,
  `clipnorm`/`clipvalue`): the torch optimizers' in-place `_foreach` kernels become in-place
  ops on the graph's inputs, which are the Keras variables' own tensors;
- the writes back: every variable the step assigned (optimizer iterations, metric totals,
  BatchNormalization's moving statistics, a seed generator's state) is copied into the
  variable's tensor at the end of the graph.

So one call of the graph (with the variables' tensors and the batch) is one Keras step, with
the same numbers: the weights, optimizer slots and metrics equal those of Keras' own step
bit for bit where the same kernels run (tests compare within 1e-5).

Tracing with fake tensors refuses what a graph cannot hold: Python control flow on a tensor's
value (`if ops.sum(x) > 0`), `.item()`/`.numpy()` in `call`, a float16 `LossScaleOptimizer`
(it branches on finiteness in Python), a seeded Dropout or other seeded random layer (Keras'
torch RNG seeds a `torch.Generator` from the seed tensor's value), an optimizer option that
branches on the step count (`gradient_accumulation_steps`, an EMA overwritten every N steps).
A model whose class overrides `train_step` is refused before any tracing: the traced step is
Keras' own step, and the override would silently not run. Such a model keeps its own step
(Keras' or keras-perf's), `traced_step_state(model)["reason"]` says why, and one
`keras_perf.KerasPerfWarning` is given. An unseeded Dropout traces: it calls torch's own
dropout, which draws from torch's global generator when the graph runs (the same masks as
Keras' eager step under the same seed).

On a `kp.LossScaleTrainStep` model the traced step is keras-perf's step with
`microbatches=1`: `clipnorm` of the global gradient norm, the non-finite skip, `grad_norm`,
`skipped_steps` and `loss_scale` in the logs. On a CPU the skip is decided on the host between
two graphs (`_SplitStep`: the update then runs in place, as Keras' own step); on a GPU the
update is computed into copies and selected with `torch.where` in one graph, so the host
never waits for the device. `microbatches > 1`, `remat` and loss scaling fall back to
keras-perf's own step with the reason.

`inductor=True` runs each traced graph through `torch.compile` (inductor): it fuses the
elementwise work (Adam, metrics) into a few C++ kernels, which pays on an MLP, and costs
seconds of compilation per input signature (see docs/accelerate.md for the measurements).

An installed step also runs `steps_per_execution > 1`, which Keras' torch backend refuses
(`_torch_executions.py`); `remove_traced_step` sets it back to 1.
"""

from __future__ import annotations

import warnings

import keras

if keras.backend.backend() != "torch":  # a train-step backend module, as torch.py
    raise ImportError(
        "keras_perf.train_step.torch_traced is keras-perf's traced train step for the PyTorch "
        f"backend; Keras runs on {keras.backend.backend()}. Set KERAS_BACKEND=torch to use it "
        "(on TensorFlow and JAX the train step is already one compiled graph)."
    )

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from keras_perf import _keras_internals as keras_internals  # noqa: E402
from keras_perf._utils import KerasPerfWarning  # noqa: E402
from keras_perf.train_step import _torch_executions as executions  # noqa: E402
from keras_perf.train_step._base import TrainStepBase  # noqa: E402
from keras_perf.train_step._torch_kp_step import _detached, _kp_update, _SplitStep  # noqa: E402

__all__ = [
    "install_traced_step",
    "remove_traced_step",
    "traced_step_state",
    "traced_step_unsupported",
]

_ATTR = "_kp_traced_step"

#: The devices where keras-perf's traced step checks the gradients' finiteness on the host
#: between two graphs (`_SplitStep`) rather than selecting with `torch.where` in one graph.
SPLIT_DEVICES = frozenset({"cpu"})
_NOOPS = (torch.ops.aten.detach.default, torch.ops.aten.lift_fresh_copy.default)


def install_traced_step(model: keras.Model, *, inductor: bool = False) -> None:
    """Make the next `model.fit` train with keras-perf's traced step (PyTorch backend).

    In place: the same model keeps its weights, optimizer, loss, metrics and callbacks; only
    how a step runs changes. `model.compile(...)` again returns it to Keras' own step; the
    model's saved form does not change.

    Args:
        model: A compiled `keras.Model` (Sequential, Functional, subclassed, or a
            `kp.LossScaleTrainStep` model).
        inductor: Run the traced graphs through `torch.compile` (inductor). Defaults to
            `False`.

    Raises:
        TypeError: `model` is not a Keras model.
        ValueError: `model` is not compiled.

    Example:
        >>> import keras, numpy as np
        >>> from keras_perf.train_step.torch_traced import install_traced_step
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile("adam", "mse")
        >>> install_traced_step(model)
        >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0)
        >>> traced_step_state(model)["active"]
        True
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(f"Model '{model.name}' is not compiled: call `model.compile(...)` first.")
    if not isinstance(inductor, bool):
        raise TypeError(f"`inductor` must be True or False, got {inductor!r}.")
    remove_traced_step(model)
    step = _TracedStep(model, inductor=inductor)
    object.__setattr__(model, _ATTR, step)
    object.__setattr__(model, "train_step", step)
    for name in _HOOKS:
        object.__setattr__(model, name, getattr(step, name))
    model.train_function = model.test_function = model.predict_function = None


def remove_traced_step(model: keras.Model) -> None:
    """Return `model` to Keras' own train step (or keras-perf's): the next `fit` runs it.
    A `steps_per_execution` above 1, which only the installed step runs on torch, is set back
    to 1."""
    installed = model.__dict__.get(_ATTR)
    _uninstall(model)
    model.__dict__.pop(_ATTR, None)
    if installed is not None and installed.installed and executions.steps_per_execution(model) > 1:
        model.steps_per_execution = 1


# The Trainer's hooks an installed step replaces (on the instance).
_HOOKS = ("make_train_function", "make_test_function", "make_predict_function")


def _uninstall(model) -> None:
    """Take the installed step's hooks off `model` (its state, with the reason, stays)."""
    for name in ("train_step", *_HOOKS):
        model.__dict__.pop(name, None)
    model.train_function = model.test_function = model.predict_function = None


def traced_step_state(model: keras.Model) -> dict:
    """Whether the traced step applies to `model`, and if not, why.

    Returns:
        `{"active": bool, "reason": None or str, "inductor": bool, "signatures": int}`:
        `active` is True when the next step runs traced (after `install_traced_step` or
        with `traced_step=True` on a `kp.LossScaleTrainStep` model, until it fell back or was
        compiled again); `reason` says why it fell back (None if it did not);
        `signatures` counts the input signatures traced so far.
    """
    step = model.__dict__.get(_ATTR)
    if step is None:
        setting = (
            getattr(model, "traced_step", False) if isinstance(model, TrainStepBase) else False
        )
        return {
            "active": setting is not False,
            "reason": None,
            "inductor": setting == "inductor",
            "signatures": 0,
        }
    step.check_compiled()
    return {
        "active": step.reason is None and _installed(model, step),
        "reason": step.reason,
        "inductor": step.inductor,
        "signatures": len(step.cache),
    }


def traced_step_for(model: keras.Model, inductor: bool = False) -> _TracedStep:
    """The traced step of a `kp.LossScaleTrainStep` model with `traced_step=True` (made once)."""
    step = model.__dict__.get(_ATTR)
    if step is None or step.inductor != inductor or step.installed:
        step = _TracedStep(model, inductor=inductor, installed=False)
        object.__setattr__(model, _ATTR, step)
    return step


def _installed(model, step) -> bool:
    if step.installed:
        return model.__dict__.get("train_step") is step
    return getattr(model, "traced_step", False) is not False


class _Fallback(Exception):
    """The model cannot use the traced step; the message says why."""


class _TracedStep:
    """The traced step of one model: its graphs per input signature, or why it fell back."""

    def __init__(self, model, inductor=False, installed=True):
        self.model = model
        self.inductor = inductor
        self.installed = installed
        self.reason = None
        self.cache = {}
        self.compile_config = keras_internals.compile_config(model)
        self.optimizer = model.optimizer
        self.lists_key = None

    # -- Keras' hooks ---------------------------------------------------------------------
    def make_train_function(self, force=False):
        """Keras' own `make_train_function` (fit calls it once per fit), never under
        `torch.compile`: the step is already one graph. With `steps_per_execution` N > 1
        (installed step only), a function that runs the N batches Keras hands over one after
        the other and returns the last step's logs, as Keras' JAX trainer does."""
        model = self.model
        self.lists_key = None  # the variables are read again at this fit's first step
        active = self.check_compiled()
        if self._runs_executions():  # also once fallen back: each batch then runs plain
            return executions.function(model, "train", force)
        if not active:
            return type(model).make_train_function(model, force)
        jit = model.jit_compile
        try:
            model.jit_compile = False
            return type(model).make_train_function(model, force)
        finally:
            model.jit_compile = jit

    def make_test_function(self, force=False):  # Keras' own, or whole executions
        return self._made("test", force)

    def make_predict_function(self, force=False):  # Keras' own, or whole executions
        return self._made("predict", force)

    def _made(self, kind, force):
        model = self.model
        self.check_compiled()
        if self._runs_executions():
            return executions.function(model, kind, force)
        return getattr(type(model), f"make_{kind}_function")(model, force)

    def _runs_executions(self) -> bool:
        """Whether this step, installed and not compiled over, runs `steps_per_execution` > 1
        (which Keras' own torch functions refuse), also after falling back."""
        m = self.model
        return self.installed and m.__dict__.get("train_step") is self and m.steps_per_execution > 1

    def check_compiled(self) -> bool:
        """False (and the model back to Keras' own step) once the model was compiled again."""
        model = self.model
        if (
            keras_internals.compile_config(model) is not self.compile_config
            or model.optimizer is not self.optimizer
        ) and (self.reason is None or not self.installed):
            if not self.installed:  # the `traced_step` setting: it holds for the new compile
                self.__init__(model, self.inductor, installed=False)
                return True
            self.reason = (
                "the model was compiled again after the traced step was installed; it trains "
                "with Keras' own step (install the traced step again to use it)"
            )
            if self.installed:
                _uninstall(model)
        return self.reason is None

    def __call__(self, data):
        model = self.model
        if not self.check_compiled():
            return type(model).train_step(model, data)
        if self.reason is not None:
            return self.plain(data)
        flat, spec = torch.utils._pytree.tree_flatten(data)
        if not all(isinstance(t, torch.Tensor) for t in flat):
            return self.plain(data)
        if self.lists_key is None:
            self.variables = _state_variables(model)
            self.lists_key = tuple(id(v) for v in self.variables)
        key = (spec, self.lists_key, *((t.shape, t.dtype, t.device) for t in flat))
        entry = self.cache.get(key)
        if entry is None:
            try:
                entry = self.cache[key] = self.trace(spec, flat)
            except _Fallback as e:
                return self.fall_back(str(e), data)
            except Exception as e:  # make_fx refuses what a graph cannot hold
                return self.fall_back(
                    f"tracing the step failed ({type(e).__name__}: {_first_line(e)})", data
                )
        values = keras_internals.held_values(self.variables)
        with torch.no_grad():
            if isinstance(entry, _SplitStep):
                try:
                    graph, keys, outs = entry.run(values, flat)
                except _Fallback as e:
                    return self.fall_back(str(e), data)
                except Exception as e:  # the skip graph is traced at the first skipped step
                    return self.fall_back(
                        f"tracing the step failed ({type(e).__name__}: {_first_line(e)})", data
                    )
                return dict(zip(keys, graph(*values, *flat, *outs)))
            graph, keys = entry
            return dict(zip(keys, graph(*values, *flat)))

    def plain(self, data):
        """The model's own step: keras-perf's eager step (its `train_step` would enter this
        traced step again where the `traced_step` setting is on), or the class's."""
        eager = getattr(type(self.model), "_kp_eager_step", None)
        if eager is not None:
            return eager(self.model, data)
        return type(self.model).train_step(self.model, data)

    def fall_back(self, reason, data):
        self.reason = reason
        self.cache.clear()
        warnings.warn(
            f"Model '{self.model.name}' cannot use keras-perf's traced train step: {reason}. It "
            "trains with the model's own step; `traced_step_state(model)` keeps the reason.",
            KerasPerfWarning,
            stacklevel=3,
        )
        return self.plain(data)

    # -- tracing --------------------------------------------------------------------------
    def trace(self, spec, flat):
        model = self.model
        _check_supported(model)
        variables = self.variables
        tv = list(model.trainable_variables)
        n_tv = len(tv)
        log_keys = []
        index = {id(v): i for i, v in enumerate(variables)}
        kp_step = isinstance(model, TrainStepBase)

        def forward(*args):
            state, tensors = list(args[: len(variables)]), list(args[len(variables) :])
            data = torch.utils._pytree.tree_unflatten(tensors, spec)
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            batch = next(t for t in keras.tree.flatten(x) if t is not None).shape[0]
            mapping = dict(zip(index, state))
            with torch.enable_grad():
                leaves = [state[i].detach().requires_grad_(True) for i in range(n_tv)]
                scope_map = [(v, mapping[id(v)]) for v in variables]
                scope_map[:n_tv] = [(v, t) for v, t in zip(tv, leaves)]
                with keras.StatelessScope(state_mapping=scope_map, collect_losses=True) as fwd:
                    kwargs = {"training": True} if model._call_has_training_arg else {}
                    y_pred = model(x, **kwargs)
                    losses = model.losses
                    if losses:
                        model._losses_override.clear()
                        model._losses_override = losses
                    try:
                        loss = model._compute_loss(
                            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                        )
                    finally:
                        if losses:
                            model._losses_override.clear()
                    if kp_step:
                        model._kp_track_loss(loss, None, batch)
                    else:
                        model._loss_tracker.update_state(loss, sample_weight=batch)
                    scaled = model.optimizer.scale_loss(loss)
                grads = torch.autograd.grad(scaled, leaves, allow_unused=True)
            grads = [None if g is None else g.detach() for g in grads]
            after_fwd = [fwd.get_current_value(v) for v in variables]
            after_fwd = [s if a is None else a for s, a in zip(state, after_fwd)]
            _check_unmapped(fwd, index)
            return grads, after_fwd, state, x, y, y_pred, sample_weight

        def step(*args):
            grads, after_fwd, state, x, y, y_pred, sample_weight = forward(*args)
            with torch.no_grad():
                return _finish(grads, after_fwd, state, x, y, y_pred, sample_weight)

        def _finish(grads, after_fwd, state, x, y, y_pred, sample_weight):
            if kp_step:
                new, logs = _kp_update(model, variables, state, after_fwd, grads, n_tv,
                                       (x, y, y_pred, sample_weight))  # fmt: skip
            else:
                scope_map = [(v, t) for v, t in zip(variables, after_fwd)]
                scope_map[:n_tv] = list(zip(tv, state[:n_tv]))
                with keras.StatelessScope(state_mapping=scope_map) as upd:
                    model.optimizer.apply(list(grads), tv)
                    logs = model.compute_metrics(x, y, _detached(y_pred), sample_weight)
                _check_unmapped(upd, index)
                new = [upd.get_current_value(v) for v in variables]
                new = [a if n is None else n for a, n in zip(after_fwd, new)]
            for target, value in zip(state, new):
                if value is not target:
                    target.copy_(value)
            log_keys[:] = list(logs)
            return [logs[k] for k in log_keys]

        values = [v.value for v in variables]
        if kp_step and all(t.device.type in SPLIT_DEVICES for t in values):
            split = _SplitStep(self, forward, spec, len(flat))
            split.gradients = self._graph(split.gradients_step, values, flat)
            return split
        return self._graph(step, values, flat), tuple(log_keys)

    def _graph(self, fn, values, flat):
        """`fn` traced on the variables' tensors and the batch's into one aten graph."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # make_fx's own deprecation notes
            try:
                # Images in the memory layout they come in: no channels-first copies around
                # each convolution and pooling (`_keras_internals`; 2.5x on a small CNN here).
                with keras_internals.torch_spatial_transposes_as_views():
                    graph = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(
                        *values, *flat
                    )
            except _Fallback:
                raise
            except Exception:  # noqa: BLE001 - a view Keras' copy allowed: its copies then
                graph = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(
                    *values, *flat
                )
        _simplify(graph)
        if self.inductor:
            graph = torch.compile(graph, dynamic=False)
        return graph


def _first_line(e) -> str:
    """The first non-empty line of what `e` says, or what its kind means where it says nothing
    (torch's data-dependent guard often has no message)."""
    text = [line.strip() for line in str(e).splitlines() if line.strip()]
    if text:
        return text[0][:200]
    if "DataDependent" in type(e).__name__:
        return (
            "the step branches on a computed tensor's value: Python control flow on a value, "
            "a seeded random layer, or an optimizer option that branches on the step count "
            "(gradient_accumulation_steps, an EMA overwritten every N steps)"
        )
    return "no message"


def _state_variables(model):
    """Every variable a step reads or writes, trainable ones first (unique, in order)."""
    seen, out = set(), []
    lists = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables,
        model.metrics_variables,
    )
    for group in lists:
        for v in group:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def traced_step_unsupported(model: keras.Model) -> str | None:
    """Why keras-perf's traced step would fall back on `model` as it is set up now (known
    before any step: a `train_step` of the model's own class, float16 loss scaling,
    `microbatches > 1`, `remat`), or None. What only
    tracing finds out (Python control flow on tensor values) shows at the first step.

    Args:
        model: A compiled `keras.Model`.

    Returns:
        The reason as a sentence, or None.
    """
    try:
        _check_supported(model)
    except _Fallback as e:
        return str(e)
    return None


def _own_train_step(model) -> str | None:
    """The class that overrides Keras' (or keras-perf's) `train_step` on `model`, or None."""
    owner = next(c for c in type(model).__mro__ if "train_step" in vars(c))
    if owner in keras.Model.__mro__ or owner.__module__.startswith("keras_perf.train_step."):
        return None  # Keras' trainer, or keras-perf's step (traced as `_kp_update`)
    return owner.__qualname__


def _check_supported(model):
    owner = _own_train_step(model)
    if owner is not None:
        raise _Fallback(
            f"{owner} overrides train_step, which the traced step would not run (it traces "
            "Keras' own step: the forward pass, the loss, the optimizer and the metrics)"
        )
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        raise _Fallback(
            "a LossScaleOptimizer (float16 loss scaling) decides in Python whether the "
            "gradients are finite, which a traced graph cannot"
        )
    if isinstance(model, TrainStepBase):
        if model.microbatches > 1:
            raise _Fallback(
                f"microbatches={model.microbatches} is not traced (only microbatches=1 is)"
            )
        if model.remat is not None:
            raise _Fallback(
                f"remat={model.remat!r} recomputes layers in the backward pass, which the "
                "traced graph does not (it would keep every activation)"
            )


def _check_unmapped(scope, index):
    other = [k for k in scope.state_mapping if k not in index]
    if other:
        raise _Fallback(
            "the step assigns a variable that the model, its optimizer and its metrics do not track"
        )


def _simplify(graph) -> None:
    """Drop the nodes that do nothing at run time (detach, copies of constants)."""
    for node in list(graph.graph.nodes):
        if (
            node.op == "call_function"
            and node.target in _NOOPS
            and not any(_writes(user) for user in node.users)
        ):
            node.replace_all_uses_with(node.args[0])
            graph.graph.erase_node(node)
    _stack_slice_gradients(graph.graph)
    graph.graph.eliminate_dead_code()
    graph.recompile()


def _stack_slice_gradients(graph) -> None:
    """One `stack` for the gradient of a tensor read slice by slice, in place of a sum of
    zero-padded slices.

    Keras' recurrent layers on torch's CPU read their inputs one time step at a time
    (`x[t]`), and autograd's gradient of `x[t]` is a zero tensor the size of all of `x` with the
    slice written in (`select_backward`): T steps cost T full-size zero tensors and T - 1
    full-size additions (an LSTM of 32 steps: two thirds of its step's time here). Where such
    gradients, one per index of the whole dimension, are only summed with each other, the sum
    is their `stack`: the same values (each element is one gradient plus zeros).
    """
    select_backward = torch.ops.aten.select_backward.default
    add = torch.ops.aten.add.Tensor

    def leaves(root):
        """The select_backward leaves of an add-tree rooted at `root` (None if not one).
        A loop, not recursion: a sequence of thousands of steps is a chain that deep."""
        out, todo = [], [root]
        while todo:
            node = todo.pop()
            if node.target is select_backward:
                out.append(node)
                continue
            if node.target is not add or node.kwargs or len(node.args) != 2:
                return None
            for arg in node.args:
                if not isinstance(arg, torch.fx.Node):
                    return None
                if arg.target is add and len(arg.users) != 1:
                    return None
                todo.append(arg)
        return out

    for node in list(graph.nodes):
        if node.target is not add or any(u.target is add for u in node.users):
            continue  # not the root of an add-tree
        found = leaves(node)
        if not found:
            continue
        sizes, dim = list(found[0].args[1]), found[0].args[2]
        if any(list(n.args[1]) != sizes or n.args[2] != dim for n in found):
            continue
        dim = dim % len(sizes)
        by_index = {n.args[3] % sizes[dim]: n for n in found}
        if len(by_index) != len(found) or sorted(by_index) != list(range(sizes[dim])):
            continue
        with graph.inserting_before(node):
            stacked = graph.call_function(
                torch.ops.aten.stack.default,
                ([by_index[i].args[0] for i in range(sizes[dim])], dim),
            )
        stacked.meta = dict(node.meta)
        node.replace_all_uses_with(stacked)


def _writes(node) -> bool:
    """Whether `node` is an op that writes one of its arguments in place."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.op != "output"
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)

"""Gradient checkpointing (remat) of an existing model, applied during the train step.

Keras reads a layer's remat mode (`keras.RematScope`) when the layer is created, so a scope
around `fit` does nothing to a model that is already built (/work/shared/FACTS.md). Keras'
mechanism is `keras.remat(fn)` around a layer's `call` (`Operation.rematerialized_call`): here
the same wrapping is applied to the selected layers only while the train step runs the
forward pass, and removed right after, so the model, its weights and its saved form never
change.

Two things differ from Keras' own wrapping, both for exactness on all three backends:

- only tensors are handed to `keras.remat`; keyword and non-tensor arguments (`training=`,
  masks given by keyword are tensors and go positionally) are bound in a closure, because
  TensorFlow's `recompute_grad` rejects keyword arguments in graph mode;
- a layer that owns a non-trainable variable is never recomputed: its call may change state
  (BatchNormalization's moving statistics, a Dropout or noise layer's seed, a quantizer's
  range), and running it again in the backward pass would change it twice (torch), leak the
  update out of `jax.checkpoint` (JAX) or draw a different random mask. Its sublayers that
  own no such variable are recomputed instead;
- a layer whose gradient with respect to a weight is sparse (`Embedding`: a gather of rows,
  `tf.IndexedSlices` on TensorFlow) is never recomputed either: TensorFlow's
  `recompute_grad` hands the gradient back dense, and Keras' Adam updates a dense gradient
  differently from a sparse one (every row's moments decay, not only the rows looked up:
  weights 5e-3 away after 16 steps). Its input is kept anyway; recomputing it saves nothing.
"""

from __future__ import annotations

import contextlib
import math
import threading

import keras
from keras import ops

from keras_perf import _keras_internals as keras_internals
from keras_perf._utils import check_number, iter_layers

MODES = ("full", "activations", "larger_than")
DEFAULT_THRESHOLD = 1024
_LOCK = threading.Lock()


def _direct_sublayers(layer):
    return [x for x in keras_internals.direct_sublayers(layer) if isinstance(x, keras.layers.Layer)]


# Layers whose gradient with respect to a weight is sparse on TensorFlow (a gather of rows).
_SPARSE_GRADIENT = (keras.layers.Embedding,)


def _kept(layer) -> bool:
    """Whether `layer` itself is never recomputed: it owns state, or a weight with a sparse
    gradient (`_SPARSE_GRADIENT`, anywhere inside it)."""
    if _stateful(layer):
        return True
    if isinstance(layer, _SPARSE_GRADIENT):
        return True
    return any(isinstance(sub, _SPARSE_GRADIENT) for sub in iter_layers(layer))


def _stateful(layer) -> bool:
    """Whether `layer` (or anything in it) owns a non-trainable variable (or a seed)."""
    if getattr(layer, "seed_generator", None) is not None:
        return True
    try:
        return bool(layer.non_trainable_variables)
    except (AttributeError, ValueError):
        return False


def check_remat(remat, threshold):
    """Validate `remat` and `remat_threshold`; returns them normalised (names as a tuple)."""
    if remat is None or isinstance(remat, str):
        if remat is not None and remat not in MODES:
            raise ValueError(
                f"`remat` must be None, one of {', '.join(repr(m) for m in MODES)} or a list of "
                f"layer names; got {remat!r}."
            )
    elif isinstance(remat, (list, tuple)):
        if not remat or not all(isinstance(n, str) for n in remat):
            raise ValueError(
                f"`remat` as a list must hold one or more layer names (str); got {remat!r}."
            )
        remat = tuple(remat)
    else:
        raise ValueError(
            f"`remat` must be None, one of {', '.join(repr(m) for m in MODES)} or a list of "
            f"layer names; got {remat!r} of type {type(remat).__name__}."
        )
    if threshold is not None:
        if remat != "larger_than":
            raise ValueError(
                f'`remat_threshold` goes with remat="larger_than" only; got remat={remat!r} '
                f"and remat_threshold={threshold!r}."
            )
        threshold = check_number("remat_threshold", threshold, low=0.0, low_inclusive=False)
    return remat, threshold


def check_remat_names(model, remat) -> None:
    """Raise if a listed layer name is not in `model`, or names a stateful layer."""
    if not isinstance(remat, tuple):
        return
    layers = {layer.name: layer for layer in iter_layers(model)}
    if not layers:
        return  # a subclassed model before its first call: checked again at the first step
    missing = [n for n in remat if n not in layers]
    if missing:
        raise ValueError(
            f"`remat` names layers that model '{model.name}' does not have: {missing}. "
            f"Its layers: {sorted(layers)}."
        )
    stateful = [n for n in remat if _stateful(layers[n])]
    if stateful:
        raise ValueError(
            f"`remat` names layers whose call changes their state (moving statistics, random "
            f"seeds): {stateful}; recomputing them would change it twice. Leave them out."
        )
    sparse = [n for n in remat if _kept(layers[n])]
    if sparse:
        raise ValueError(
            f"`remat` names layers with a sparse weight gradient (Embedding): {sparse}; "
            "recomputed, their gradient would be dense on TensorFlow, which Adam updates "
            "differently. Leave them out (their input is kept anyway)."
        )


def _per_example(shape) -> int:
    return math.prod(int(d) if d is not None else 1 for d in tuple(shape)[1:])


def _output_elements(layer):
    """Elements per example of `layer`'s largest output in the model's graph, or None."""
    sizes = [_per_example(shape) for shape in keras_internals.inbound_output_shapes(layer)]
    return max(sizes) if sizes else None


def plan(model, remat, threshold):
    """The layers to recompute: [(layer, "call" | "activation")], outermost first.

    A layer is recomputed whole when it owns no state and no weight with a sparse gradient;
    such a container is opened and its sublayers considered instead. Names (a tuple) select those layers only.
    """
    if remat is None:
        return []
    if isinstance(remat, tuple):
        check_remat_names(model, remat)
        return [(layer, "call") for layer in iter_layers(model) if layer.name in remat]
    threshold = DEFAULT_THRESHOLD if threshold is None else threshold
    chosen = []

    def visit(layer):
        if remat == "activations":
            owner = _activation_owner(layer)
            activation = getattr(owner, "activation", None)
            if activation is not None and activation is not keras.activations.linear:
                chosen.append((layer, "activation"))
            for sub in _direct_sublayers(layer):
                if owner is layer or sub is not owner:  # a recurrent layer swaps its cell's
                    visit(sub)
            return
        if _kept(layer) or isinstance(layer, keras.layers.InputLayer):
            for sub in _direct_sublayers(layer):
                visit(sub)
            return
        if remat == "full":
            chosen.append((layer, "call"))
            return
        size = _output_elements(layer)
        if size is not None and size > threshold:
            chosen.append((layer, "call"))
        else:
            for sub in _direct_sublayers(layer):
                visit(sub)

    for layer in _direct_sublayers(model):
        visit(layer)
    return chosen


def _rematted_call(call):
    """`call` recomputed in the backward pass; only tensors go through `keras.remat`.

    The recomputation runs under the same variable autocasting as the call (mixed precision):
    on torch it runs in the backward pass, after the layer's own scope has closed.
    """

    def wrapped(*args, **kwargs):
        flat = keras.tree.flatten((args, kwargs))
        where = [i for i, t in enumerate(flat) if ops.is_tensor(t)]
        if not where:
            return call(*args, **kwargs)
        dtype = keras_internals.autocast_dtype()

        def run(*tensors):
            leaves = list(flat)
            for i, t in zip(where, tensors):
                leaves[i] = t
            a, kw = keras.tree.pack_sequence_as((args, kwargs), leaves)
            with keras_internals.autocast_scope(dtype):
                return call(*a, **kw)

        return keras.remat(run)(*[flat[i] for i in where])

    return wrapped


def _activation_owner(layer):
    """What holds the `activation` a call of `layer` reads: the layer, or for a recurrent layer
    its cell (the layer's `activation` is a read-only property forwarding to the cell's, and
    Keras' fused LSTM and GRU kernels on JAX and torch read the cell's attribute in the
    layer's call, outside the cell's)."""
    if isinstance(getattr(type(layer), "activation", None), property):
        cell = getattr(layer, "cell", None)
        return cell if cell is not None and "activation" in vars(cell) else None
    return layer


def _rematted_activation(layer, call):
    owner = _activation_owner(layer)

    def wrapped(*args, **kwargs):
        original = owner.activation
        object.__setattr__(owner, "activation", keras.remat(original))
        try:
            return call(*args, **kwargs)
        finally:
            object.__setattr__(owner, "activation", original)

    return wrapped


@contextlib.contextmanager
def applied(layers):
    """While inside: the planned layers' calls (or activations) are recomputed in backward.

    Re-entrant and safe across threads (tf.distribute replicas trace in threads): the first
    entry wraps, the last exit restores.
    """
    if not layers:
        yield
        return
    with _LOCK:
        for layer, how in layers:
            count = layer.__dict__.get("_kp_remat_depth", 0)
            if count == 0:
                call = layer.call  # the bound method of the class
                wrapper = (
                    _rematted_call(call) if how == "call" else _rematted_activation(layer, call)
                )
                object.__setattr__(layer, "call", wrapper)
            object.__setattr__(layer, "_kp_remat_depth", count + 1)
    try:
        yield
    finally:
        with _LOCK:
            for layer, _ in layers:
                count = layer.__dict__["_kp_remat_depth"] - 1
                object.__setattr__(layer, "_kp_remat_depth", count)
                if count == 0:
                    object.__delattr__(layer, "call")
                    object.__delattr__(layer, "_kp_remat_depth")


class RematSettings:
    """The `remat` and `remat_threshold` settings of the train step (a base of
    `TrainStepBase`): validated, changeable between fits (the train function is re-made),
    saved with the model's config, and applied around the forward pass by `_kp_remat()`."""

    def __init__(self, *args, remat=None, remat_threshold=None, **kwargs):
        self._remat, self._remat_threshold = check_remat(remat, remat_threshold)
        super().__init__(*args, **kwargs)
        # Not tracked (Keras would adopt the listed layers as sublayers of a tracked list).
        object.__setattr__(self, "_kp_remat_plan", None)

    @property
    def remat(self):
        """None, "full", "activations", "larger_than" or a tuple of layer names."""
        return self._remat

    @remat.setter
    def remat(self, value) -> None:
        threshold = self._remat_threshold if value == "larger_than" else None
        self.set_remat(value, threshold)

    @property
    def remat_threshold(self):
        """Elements per example above which "larger_than" recomputes a layer's output."""
        return self._remat_threshold

    @remat_threshold.setter
    def remat_threshold(self, value) -> None:
        self.set_remat(self._remat, value)

    def set_remat(self, remat, remat_threshold=None) -> None:
        """Set both remat settings at once (validated first, the model unchanged on error)."""
        remat, remat_threshold = check_remat(remat, remat_threshold)
        if getattr(self, "built", False):
            check_remat_names(self, remat)
        if (remat, remat_threshold) != (self._remat, self._remat_threshold):
            self._remat, self._remat_threshold = remat, remat_threshold
            object.__setattr__(self, "_kp_remat_plan", None)
            self.train_function = None  # Keras rebuilds it on the next fit

    def _kp_remat(self):
        """Context for the forward pass of the train step: the planned layers recomputed."""
        if self._remat is None:
            return contextlib.nullcontext()
        if self._kp_remat_plan is None:
            layers = plan(self, self._remat, self._remat_threshold)
            object.__setattr__(self, "_kp_remat_plan", layers)
        return applied(self._kp_remat_plan)

    def get_config(self):
        config = super().get_config()
        remat = list(self._remat) if isinstance(self._remat, tuple) else self._remat
        config.update({"remat": remat, "remat_threshold": self._remat_threshold})
        return config

"""Twins kept from one `accelerate` call to the next on the same model.

Why: every fresh twin's first `fit` traces and compiles its train function, and some of what
that leaves is never freed. On TensorFlow each program XLA compiles stays for the life of the
process (6 MiB for a small MLP's `jit_compile=True` train function) and each other trace keeps
about 0.4 MiB (TF 2.21, Keras 3.15; docs/diagnose.md); a call times about a dozen twins, so a notebook
calling `accelerate` again and again on one model grew by 11-12 MiB a call. A twin that is
kept is reset and fitted again with the function it already traced: nothing new is compiled.

A kept twin is reused only where nothing it was made from has changed: the same compile
(Keras makes a new compile config at every `model.compile`), the same model config, variables
(paths, shapes, dtypes, trainable), optimizer config, keras-perf train-step settings, installed
traced step, `jit_compile`/`steps_per_execution`/`run_eagerly` and global dtype policy. It is
reset to what a fresh twin holds: the values of every variable of it, its optimizer's (where
built when the twin was made; else those a fresh optimizer of its configuration holds once
built on the twin) and its metrics' as they were when it was made, then the user's current
weights.

Bounded: twins are kept for one model at a time (the last one `accelerate` measured; calling
it on another model, recompiling or changing the model releases them, as does collecting the
model), one per candidate and role, and only while the kept twins' variables and their host
copies take at most `MAX_BYTES` together; past that, twins are released after the call as
before. The candidates are a short list (the pairs among them vary with what paid), so the
twins kept level off.
"""

from __future__ import annotations

import json
import weakref

import keras

from keras_perf import _keras_internals as keras_internals
from keras_perf import backend as _backend
from keras_perf._fit_measure import Snapshot, start_weights
from keras_perf._utils import host_copy

# The most the kept twins may hold: their variables' values and the host copies they are reset
# from (so a 1 MiB float32 model with Adam costs about 6 MiB a twin).
MAX_BYTES = 64 * 2**20


def _signature(model):
    """What a kept twin was made from, or None where it cannot be read (nothing is kept)."""
    from keras_perf.train_step import LossScaleTrainStep, installed_traced_step, settings

    try:
        config = json.dumps(model.get_config(), sort_keys=True, default=repr)
        optimizer = json.dumps(model.optimizer.get_config(), sort_keys=True, default=repr)
    except Exception:  # noqa: BLE001 - a model without a readable config is not kept
        return None
    variables = tuple(
        (v.path, tuple(v.shape), str(v.dtype), bool(v.trainable)) for v in model.variables
    )
    step = repr(sorted(settings(model).items())) if isinstance(model, LossScaleTrainStep) else None
    traced = installed_traced_step(model) if keras.backend.backend() == "torch" else False
    own = tuple(
        repr(getattr(model, k, None)) for k in ("jit_compile", "steps_per_execution", "run_eagerly")
    )
    return (
        config,
        optimizer,
        variables,
        step,
        traced,
        own,
        keras.mixed_precision.global_policy().name,
    )


class TwinPool:
    """The twins made for one model, kept for the calls of `accelerate` on it."""

    def __init__(self, model, compile_config, signature):
        # The twins go with the model: a pool whose model is collected releases them.
        self.model = weakref.ref(model, _drop_if_last(id(self)))
        self.compile_config = compile_config  # held: its identity says "the same compile"
        self.signature = signature
        # (candidate name, role) -> [(twin, snapshot, bytes, optimizer in the snapshot)]
        self.twins = {}
        self.in_use = set()  # ids of the twins this call has taken
        self.bytes = 0

    def make(self, ctx, candidate, role="timed"):
        """A twin for `candidate`: a kept one not yet taken by this call, reset to a fresh
        twin's state; else a new one (kept where the budget allows). `role` tells apart the
        twins one candidate has in one call (timed; checked at dropout rate 0)."""
        key = (candidate.name, role)
        for entry in list(self.twins.get(key, ())):
            twin, snapshot, _, optimizer_in_snapshot = entry
            if id(twin) in self.in_use:
                continue
            try:
                snapshot.restore()
                start_weights(ctx.model, twin, ctx.start)
                if not optimizer_in_snapshot:  # built by the twin's first fit, after the copy
                    _fresh_optimizer_state(twin)
            except Exception:  # noqa: BLE001 - a twin that cannot be reset is made anew
                self.forget(twin)
                continue
            self.in_use.add(id(twin))
            return twin
        twin = candidate.make()
        if self.signature is not None:
            self._keep(key, twin)
        return twin

    def _keep(self, key, twin) -> None:
        try:
            snapshot = Snapshot(twin)
            optimizer_in_snapshot = bool(twin.optimizer.built)
        except Exception:  # noqa: BLE001 - not kept
            return
        size = 2 * sum(value.nbytes for _, value in snapshot.pairs)
        if not optimizer_in_snapshot:  # the slots its first fit makes (Adam: two per weight)
            trainable = {id(v) for v in twin.trainable_variables}
            size += 2 * sum(value.nbytes for v, value in snapshot.pairs if id(v) in trainable)
        if self.bytes + size > MAX_BYTES:
            return
        self.twins.setdefault(key, []).append((twin, snapshot, size, optimizer_in_snapshot))
        self.in_use.add(id(twin))
        self.bytes += size

    def forget(self, twin) -> None:
        """Not kept: `twin` failed, or could not be reset."""
        for entries in self.twins.values():
            for i, entry in enumerate(entries):
                if entry[0] is twin:
                    self.bytes -= entry[2]
                    self.in_use.discard(id(twin))
                    del entries[i]
                    return

    def finish(self) -> None:
        """The end of a call: every kept twin is free for the next."""
        self.in_use.clear()


def _fresh_optimizer_state(twin) -> None:
    """The values a fresh optimizer of the twin's configuration holds once built on its
    variables, in the twin's optimizer: `iterations` 0 and fresh slots (`use_ema`'s averages
    then take the weights at the first step, as a fresh optimizer's do). Raises where the two
    do not line up (the twin is then made anew)."""
    optimizer = twin.optimizer
    if not optimizer.built:  # its first fit builds it
        return
    with _backend.model_scope(twin):
        fresh = type(optimizer).from_config(optimizer.get_config())
        fresh.build(twin.trainable_variables)
    old, new = list(optimizer.variables), list(fresh.variables)
    if len(old) != len(new) or any(
        tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype for a, b in zip(old, new)
    ):
        raise ValueError("the optimizer's variables do not line up with a fresh one's")
    for a, b in zip(old, new):
        # A host copy: JAX may hand two fresh zero slots one buffer, which its train step,
        # donating each variable's buffer, would then be given twice.
        a.assign(host_copy(b))


_LAST: list = [None]  # the pool of the model last measured


def _drop_if_last(pool_id):
    def drop(_ref):
        if _LAST[0] is not None and id(_LAST[0]) == pool_id:
            _LAST[0] = None

    return drop


def pool_for(model) -> TwinPool:
    """The pool for a call of `accelerate` on `model`: the last call's, where it was on this
    model made from the same things; else a new one (the old one's twins are released)."""
    compile_config = keras_internals.compile_config(model)
    signature = _signature(model) if compile_config is not None else None
    last = _LAST[0]
    if (
        last is not None
        and last.model() is model
        and last.compile_config is compile_config
        and signature is not None
        and last.signature == signature
    ):
        return last
    _LAST[0] = None  # released before new twins are made
    pool = TwinPool(model, compile_config, signature)
    _LAST[0] = pool
    return pool


def finish(model) -> None:
    """The end of a call of `accelerate` on `model` (see `TwinPool.finish`)."""
    last = _LAST[0]
    if last is not None and last.model() is model:
        last.finish()


def release() -> None:
    """Release every kept twin (tests; a session that wants the memory back)."""
    _LAST[0] = None

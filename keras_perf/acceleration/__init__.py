"""`kp.accelerate`: the fastest exact execution settings for a model, measured and applied.

The modules: `_candidates` (what is tried, per backend: a plug-in table), `_measure` (the
alternated timing of real `fit` calls on twins), `_exact` (a few steps against the model's own
settings), `_apply` (in place on the user's model) and `_report` (the table and JSON).
"""

from __future__ import annotations

import time
import warnings

import keras
import numpy as np

from keras_perf import _fit_measure as _dmeasure
from keras_perf import backend as _backend
from keras_perf._inputs import check_fit_data, check_no_ignored_settings
from keras_perf._inputs import sources as _data
from keras_perf._utils import KerasPerfWarning, check_bool, check_int, check_number
from keras_perf.acceleration import _apply, _callbacks, _candidates, _exact, _measure, _pool
from keras_perf.acceleration._report import Acceleration

__all__ = ["Acceleration", "accelerate"]

NOISE = 0.05  # a candidate must beat the model's own settings by more than this to be chosen
MAX_STEPS = _measure.MAX_STEPS  # an epoch of at most this many steps is timed whole
GENERATOR_BATCHES = 64  # batches taken from a one-pass generator
PHASE_ONE = 0.6  # share of max_seconds for the single settings
PHASE_TWO = 0.2  # for the pairs; the rest to confirm the chosen one in fresh rounds


class _Context:
    """What the candidates read: the model, its compile arguments and the data."""

    def __init__(self, model, source, batch_size, steps, examples, max_seconds, epoch_steps=None):
        self.model = model
        self.max_seconds = max_seconds
        self.compile_args = _dmeasure.compile_args(model)
        self.source = source
        self.batch_size = batch_size
        self.steps = steps
        self.examples = examples
        self.epoch_steps = epoch_steps  # steps of one epoch of the user's fit (None: unknown)
        self.start = None  # a model not built yet: the batch and weights every twin starts from
        self.twins = _pool.pool_for(model)  # kept from the last call

    def epoch(self, batch_size):
        """(steps, examples) of one epoch of the user's fit at `batch_size`; where the epoch's
        length is unknown, the timed window of `self.steps` steps stands for it."""
        if self.examples is not None:
            return _measure.epoch_steps_of(self.examples, batch_size), self.examples
        if self.epoch_steps is not None:
            return self.epoch_steps, self.epoch_steps * batch_size
        return self.steps, self.steps * batch_size


def _check(model, batch_size, max_seconds, exact, apply):
    if not isinstance(model, keras.Model):
        raise TypeError(f"accelerate: `model` must be a keras.Model, got {type(model).__name__}.")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(
            "accelerate: `model` is not compiled; call `model.compile(optimizer=..., loss=...)` "
            "first, as for fit."
        )
    check_number("max_seconds", max_seconds, low=0.0, low_inclusive=False)
    check_int("batch_size", batch_size, minimum=1, allow_none=True)
    check_bool("exact", exact)
    check_bool("apply", apply)


def _source(model, x, y, batch_size):
    """`diagnose`'s reading of the data; a one-pass generator is read once into memory.
    Returns `(source, notes, epoch_known)`: whether the data says how long an epoch is
    (arrays, a finite dataset, a `PyDataset` with a length)."""
    source = _data.make_source(
        x, y, batch_size, GENERATOR_BATCHES, caller="accelerate", model=model
    )
    epoch_known = not source.one_pass and (
        source.kind == "arrays" or source.batches_per_epoch is not None
    )
    notes = []
    if source.one_pass:
        batches = list(source.recorder())
        if not batches:
            raise ValueError("accelerate: the generator `x` yielded no batches.")
        size = _data.leading_dim(batches[0])
        stacked = _data.stack(batches, size)
        if stacked is None:
            raise ValueError("accelerate: the generator `x` yielded no full batch.")
        (xs, ys, sws), n = stacked
        notes.append(
            f"one-pass input: took {len(batches)} batches from it (at most "
            f"{GENERATOR_BATCHES}, as kp.diagnose reads one) and measured on them in memory"
            + ("; their sample weights were left out." if sws is not None else ".")
        )
        source = _data.ArraySource(xs, ys, size, caller="accelerate", model=model)
    return source, notes, epoch_known


def _exactness_data(source, batch_size):
    """`_exact.STEPS` batches as (x, y, sample_weight) arrays."""
    if source.kind == "arrays":
        n = min(_exact.STEPS * batch_size, source.examples)
        xs = keras.tree.map_structure(lambda a: keras.ops.convert_to_numpy(a)[:n], source.x)
        ys = (
            None
            if source.y is None
            else keras.tree.map_structure(lambda a: keras.ops.convert_to_numpy(a)[:n], source.y)
        )
        return xs, ys, None
    batches, _ = source.take(_exact.STEPS)
    stacked = _data.stack(batches, batch_size)
    return None if stacked is None else stacked[0]


@_backend.traced_graphs_released()
def accelerate(
    model, x, y=None, batch_size=None, *, max_seconds=60, exact=True, apply=True, callbacks=None
):
    """Measure the execution settings that apply to this backend, apply the fastest exact one.

    Every candidate (TensorFlow: `jit_compile` on/off, `steps_per_execution` 4/16/64 and the
    pair of the two that pay; JAX: `steps_per_execution`; torch: Keras' `jit_compile=True`
    (`torch.compile`), keras-perf's traced train step and, where it paid, the traced step with
    `steps_per_execution`, which only it runs on torch; everywhere: mixed precision where it
    may pay and twice the batch, listed but not applied) is timed with real `fit` calls on its
    own twin of `model` with this data, in alternated rounds (whole epochs where an epoch has
    at most 64 steps, longer ones scaled from 64-step fits; the fit's set-up counted once per
    3 epochs: what a 3-epoch `fit` shows), and checked against the model's
    own settings for exactness (a few steps from the same weights and batches). `model` itself
    is never trained: the fastest exact candidate that beats its own settings by more than 5 %
    is set on it in place (same object, weights, optimizer state, loss and metrics), and the
    next `model.fit` runs with it. `model.compile(...)` again makes it plain Keras.

    Args:
        model: A compiled `keras.Model`.
        x: The training data as `fit` takes it (arrays or a dict/list of them, a
            `tf.data.Dataset`, a `keras.utils.PyDataset`, a torch `DataLoader`, or a
            generator: at most 64 batches are taken from it, as `kp.diagnose` reads one).
        y: Targets when `x` is arrays. Defaults to `None`.
        batch_size: Batch size when `x` is arrays. Defaults to `None` (32, as in `fit`).
        max_seconds: Time budget for the timed fits, not counting the first trace and
            compilation of each candidate's train function. Defaults to `60`.
        exact: Only exact candidates may be chosen. Defaults to `True`.
        apply: Set the chosen settings on `model`. Defaults to `True` (`False`: measure only).
        callbacks: The callbacks you will pass to `fit`. With `steps_per_execution=N` Keras
            calls callbacks' batch-level methods once per N steps; where one of these may act
            per batch (a learning-rate warm-up set before each batch), `steps_per_execution` is
            measured but not applied. Keras' own watching callbacks (progress bar, History,
            TensorBoard, checkpoints, `TerminateOnNaN`, `CSVLogger`) and keras-perf's do
            not count. Defaults to `None` (none known: the report notes it when
            `steps_per_execution` is applied).

    Returns:
        An `Acceleration`: `chosen`, `speedup`, `rows`, `to_dict()`; `print` it for a table.

    Raises:
        ValueError: An uncompiled model, `max_seconds <= 0`, `batch_size < 1`, or data `fit`
            rejects (before anything is measured; `model` untouched).
        TypeError: Arguments of the wrong type (`callbacks` not a list of Keras callbacks).

    Example:

    ```python
    import keras, numpy as np
    import keras_perf as kp
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = np.zeros((256, 8), "float32"), np.zeros((256, 1), "float32")
    r = kp.accelerate(model, x, y, batch_size=16, max_seconds=2)
    print(r.chosen, r.speedup >= 1.0)
    ```
    """
    _check(model, batch_size, max_seconds, exact, apply)
    known = _callbacks.check_callbacks(callbacks)
    per_batch = None if callbacks is None else _callbacks.per_batch(known)
    check_no_ignored_settings("accelerate", model)
    check_fit_data("accelerate", model, x)
    source, notes, epoch_known = _source(model, x, y, batch_size)
    rng = _dmeasure.RandomState()
    try:
        return _run(model, source, float(max_seconds), exact, apply, notes, per_batch, epoch_known)
    finally:
        _pool.finish(model)
        rng.restore()


def _batch_size(source) -> int:
    if source.batch_size is not None:
        return source.batch_size
    batches, _ = source.take(1)
    size = _data.leading_dim(batches[0]) if batches else None
    if size is None:
        raise ValueError(f"accelerate: could not read a batch from the {source.kind} `x`.")
    return size


def _entry(ctx, candidate, fit_kwargs, rows_out, checker, checks):
    """The candidate's twin, checked for exactness (`checks[id(entry)]`; the baseline's twin
    becomes the reference) and warmed up; None (and a row saying why) where it cannot run."""
    twin = None
    try:
        twin = ctx.twins.make(ctx, candidate)
        epoch_steps, epoch_examples = ctx.epoch(candidate.batch_size)
        known = ctx.examples is not None or ctx.epoch_steps is not None
        steps = _measure.plan(epoch_steps if known else None, candidate.steps_multiple)
        entry = _measure.Entry(candidate, twin, fit_kwargs, steps, epoch_steps, epoch_examples)
        # Before the twin's first fit: it starts from the user's weights and a fresh optimizer.
        checks[id(entry)] = checker.check(candidate, twin)
        with warnings.catch_warnings():
            # The traced step's fallback warning is about a twin: the row says it instead.
            warnings.simplefilter("ignore", KerasPerfWarning)
            _measure.warm_up(entry)
        _apply.check_traced(twin, candidate.settings)
        return entry
    except _apply.Unavailable as e:
        rows_out.append(_row(candidate, None, None, None, note=str(e)))
    except Exception as e:  # noqa: BLE001 - a candidate that fails is listed, not fatal
        rows_out.append(_row(candidate, None, None, None, note=f"failed: {e}"[:200]))
    if twin is not None:
        ctx.twins.forget(twin)
    return None


def _base_failed(model, note) -> str:
    """The error when the twin with the model's own settings cannot be fitted."""
    message = f"accelerate: fit rejects this data or model: {note}"
    if keras.backend.backend() == "jax" and getattr(model.optimizer, "use_ema", False):
        message += (
            ". If that is a TypeError from a variable's value: Keras on JAX cannot fit a model "
            "whose optimizer has use_ema=True a second time (a plain model.fit twice raises "
            "it too, Keras 3.15), and accelerate fits each twin several times; compile with "
            "use_ema=False to measure the settings."
        )
    return message


def _row(candidate, eps, exact_ok, diff, note=None, speedup=None):
    return {
        "candidate": candidate.name,
        "settings": dict(candidate.settings),
        "examples_per_s": eps,
        "speedup": speedup,
        "exact": exact_ok,
        "max_abs_diff": diff,
        "chosen": False,
        "note": note if note is not None else candidate.note,
    }


def _run(model, source, max_seconds, exact, apply, notes, per_batch=None, epoch_known=True):
    """`per_batch`: the names of the user's callbacks that may act per batch (None: the
    callbacks are not known); `epoch_known`: whether the data says how long an epoch is."""
    t_start = time.perf_counter()
    B = _batch_size(source)
    if source.kind == "arrays":
        fit_kwargs = source.fit_kwargs()
        examples = source.examples
        per_epoch = source.batches_per_epoch
    else:
        fit_kwargs = source.fit_kwargs()
        examples = None
        per_epoch = source.batches_per_epoch
    steps = min(MAX_STEPS, per_epoch) if per_epoch else MAX_STEPS
    epoch_steps = _measure.epoch_steps_of(examples, B) if examples is not None else per_epoch
    ctx = _Context(model, source, B, steps, examples, max_seconds, epoch_steps)
    exactness_data = _exactness_data(source, B)
    if exactness_data is not None:
        first = keras.tree.map_structure(lambda a: a[:B], exactness_data[0])
        ctx.start = _dmeasure.unbuilt_start(model, first)
        if ctx.start is not None:
            notes.append(
                "the model is not built yet: its twins start from one set of weights drawn for "
                "them (your fit draws its own at its first step)."
            )
    if epoch_steps is not None and epoch_steps <= MAX_STEPS:
        notes.append(
            f"timed whole epochs of {epoch_steps} steps, as your fit runs them; each figure "
            f"counts the fit's set-up once per {_measure.EPOCHS_SHOWN} epochs."
        )
    elif epoch_steps is not None:
        notes.append(
            f"timed fits of {MAX_STEPS} steps, scaled to your epoch of {epoch_steps} steps (the "
            f"epoch's own work counted once, the fit's set-up once per "
            f"{_measure.EPOCHS_SHOWN} epochs)."
        )
    else:
        notes.append(
            f"the epoch's length is unknown: timed fits of {MAX_STEPS} steps stand for an epoch."
        )
    offered, offer_notes = _candidates.candidates(ctx)
    notes.extend(offer_notes)

    rows = []
    checker = _Exactness(ctx, exactness_data, B, notes)
    checks = {}
    base = _entry(ctx, _candidates.baseline(ctx), fit_kwargs, rows, checker, checks)
    if base is None and _dmeasure.make_twin(model, ctx.start) is None:
        notes.append(
            "Keras could not clone this model (give it a get_config): nothing was measured, "
            "as accelerate never trains the model itself; nothing changed."
        )
        return Acceleration(
            chosen={},
            speedup=1.0,
            rows=[],
            applied=False,
            notes=notes,
            backend=keras.backend.backend(),
            batch_size=B,
            steps=steps,
            seconds=time.perf_counter() - t_start,
        )
    if base is None:
        raise ValueError(_base_failed(model, rows[0]["note"]))
    entries = [base]
    for c in offered:
        kw = fit_kwargs if c.batch_size == B else source.fit_kwargs(batch_size=c.batch_size)
        e = _entry(ctx, c, kw, rows, checker, checks)
        if e is not None:
            entries.append(e)

    _measure.alternate(entries, max_seconds * PHASE_ONE)
    if base.epochs == _measure.EPOCHS_SHOWN:
        notes.append(
            f"epochs this short (under {_measure.SHORT_EPOCH_S:g} s) were timed in fits of "
            f"{_measure.EPOCHS_SHOWN} epochs, as your fit runs them: a fit's first epoch costs "
            "more than the next ones."
        )

    # The pairs of single settings that each paid.
    base_eps = base.examples_per_s
    winners = sorted(
        (
            e
            for e in entries[1:]
            if e.candidate.exact_lever
            and checks[id(e)][0] is not False
            and e.examples_per_s > base_eps * (1 + NOISE)
        ),
        key=lambda e: -e.examples_per_s,
    )
    new = []
    for c in _candidates.pairs(ctx, [w.candidate for w in winners]):
        e = _entry(ctx, c, fit_kwargs, rows, checker, checks)
        if e is not None:
            new.append(e)
    if new:
        second = [base, *winners[:1], *new]
        _measure.alternate(second, max_seconds * PHASE_TWO)
        entries.extend(new)

    base_eps = base.examples_per_s
    measured = []
    for e in entries:
        eps = e.examples_per_s
        ok, diff = (True, 0.0) if e is base else checks[id(e)]
        measured.append((e, _row(e.candidate, eps, ok, diff, speedup=eps / base_eps)))

    chosen_row, chosen = None, {}
    eligible = [
        (e, r)
        for e, r in measured
        if e is not base
        and _apply.applicable(e.candidate.settings)
        and e.candidate.exact_lever
        and (r["exact"] is True or not exact)
        and r["speedup"] > 1 + NOISE
        and _held(e, r, model, per_batch, epoch_known) is None
    ]
    if eligible:
        _, chosen_row = max(eligible, key=lambda er: er[1]["examples_per_s"])
        chosen = dict(chosen_row["settings"])

    confirmed = None
    if chosen:
        # The fastest of several noisy figures is biased up (the winner's curse): the speed-up
        # reported, and the decision to apply, come from fresh rounds of the chosen one
        # against the baseline alone, not from the rounds that picked it.
        winner = next(e for e, r in measured if r is chosen_row)
        confirmed = _confirm(base, winner, max_seconds * (1 - PHASE_ONE - PHASE_TWO))
        if confirmed <= 1 + NOISE:
            chosen_row["note"] = (
                f"{chosen_row['speedup']:.2f}x in the rounds that picked it, {confirmed:.2f}x in "
                f"{_measure.MIN_ROUNDS} or more fresh rounds against the baseline: not applied"
            )
            chosen_row["unconfirmed"] = True
            chosen, chosen_row = {}, None

    base_spe = int(getattr(model, "steps_per_execution", 1) or 1)  # before it is applied
    applied = False
    if chosen and apply:
        try:
            _apply.apply(model, chosen)
            applied = True
        except _apply.Unavailable as e:
            notes.append(f"{chosen_row['candidate']} could not be applied: {e}")
            chosen, chosen_row = {}, None
    best_eps = chosen_row["examples_per_s"] if chosen_row else base_eps
    for e, r in measured:
        if r.pop("unconfirmed", False):
            continue
        r["note"] = _why(e, r, base, chosen_row, exact, apply, best_eps)
        held = _held(e, r, model, per_batch, epoch_known)
        if (
            e is not base
            and r is not chosen_row
            and e.candidate.exact_lever
            and not (r["exact"] is False and exact)
            and r["speedup"] > 1 + NOISE
            and held is not None
        ):
            r["note"] = held
        if r is chosen_row:
            r["chosen"] = True
            r["note"] += f" (confirmed in fresh rounds: {confirmed:.2f}x, r.speedup)"
    spe = chosen.get("steps_per_execution")
    if spe is not None and spe != base_spe:
        notes.append(
            f"steps_per_execution={spe}: Keras runs whole executions of {spe} steps, so a "
            f"steps_per_epoch you give fit should be a multiple of {spe} (else each epoch "
            "runs on to the next multiple)."
        )
        if keras.backend.backend() == "torch":
            notes.append(
                f"steps_per_execution={spe} on torch: where an epoch's steps are not a multiple "
                f"of {spe} (other data or another batch size than measured here), Keras' torch "
                "epoch iterator warns 'Your input ran out of data' at each epoch's end; the "
                "training is right."
            )
        if per_batch is None:
            notes.append(
                f"steps_per_execution={spe}: Keras calls callbacks' batch-level methods once "
                f"per {spe} steps; pass the callbacks you give fit as `callbacks=` and "
                "accelerate keeps steps_per_execution off where one of them may act per batch."
            )
    all_rows = [r for _, r in measured]
    all_rows.sort(key=lambda r: -r["examples_per_s"])
    all_rows.extend(rows)
    speedup = confirmed if chosen_row else 1.0
    return Acceleration(
        chosen=chosen,
        speedup=float(max(speedup, 1.0)),
        rows=all_rows,
        applied=applied,
        notes=notes,
        backend=keras.backend.backend(),
        batch_size=B,
        steps=steps,
        seconds=time.perf_counter() - t_start,
    )


def _held(e, r, model, per_batch, epoch_known) -> str | None:
    """Why entry `e`'s `steps_per_execution` may not be set on the model (its row's note), or
    None: the user's callbacks act per batch, or the data does not say how long an epoch is."""
    if not _callbacks.changes_steps_per_execution(e.candidate.settings, model):
        return None
    n = e.candidate.settings["steps_per_execution"]
    if per_batch:
        names = ", ".join(dict.fromkeys(per_batch))
        return (
            f"{r['speedup']:.2f}x; not applied: with steps_per_execution={n} Keras calls "
            f"batch-level callback methods once per {n} steps, and {names} may act per batch"
        )
    if not epoch_known:
        return (
            f"{r['speedup']:.2f}x; not applied: the data does not say how long an epoch is, and "
            f"Keras runs whole executions of {n} steps (an epoch would run on to the next "
            f"multiple of {n} past fit's steps_per_epoch); set it by hand with a multiple"
        )
    return None


def _confirm(base, winner, seconds) -> float:
    """The winner's speed-up over the baseline from fresh alternated rounds of the two."""
    fresh = [
        _measure.Entry(e.candidate, e.model, e.fit_kwargs, e.steps, e.epoch_steps, e.epoch_examples)
        for e in (base, winner)
    ]
    for f, e in zip(fresh, (base, winner)):
        f.epochs = e.epochs
    _measure.alternate(fresh, max(seconds, 0.0))
    return fresh[1].examples_per_s / fresh[0].examples_per_s


def _why(e, r, base, chosen_row, exact, apply, best_eps) -> str | None:
    c = e.candidate
    if r is chosen_row:
        return "applied" if apply else "fastest exact: not applied (apply=False)"
    if e is base:
        return "the baseline" + ("" if chosen_row else ": kept (nothing faster by more than 5 %)")
    if not c.exact_lever:
        lead = f"{r['speedup']:.2f}x, not exact: " if r["speedup"] > 1 + NOISE else "not exact: "
        return lead + (c.note or "changes the result")
    if r["exact"] is False and exact:
        return f"not exact (max |diff| {r['max_abs_diff']:.1e}): not applied with exact=True"
    if r["speedup"] <= 1 + NOISE:
        if r["speedup"] < 1 - NOISE:
            return "slower than the model's own settings"
        return "within 5 % of the model's own settings (noise)"
    if r["examples_per_s"] < best_eps:
        return "slower than the chosen one"
    lead = f"{r['speedup']:.2f}x in the rounds that compared the candidates"
    if r["exact"] is None and exact:
        return f"{lead}; its exactness could not be checked: not applied with exact=True"
    if chosen_row is None:
        # Only the fastest is confirmed in fresh rounds; it was not (or could not be applied).
        return f"{lead}; not applied: the fastest of them did not hold its lead in fresh rounds"
    return c.note or lead


class _Exactness:
    """The baseline's twin trained a few steps with the model's own settings, before its first
    timed fit, is the reference (kept as an `_exact.Snapshot`); each candidate's twin, trained
    the same way before its first timed fit, is compared with it (`_exact.compare`). So each
    twin's train function is traced and compiled once, for the check and the timing alike. A
    model with dropout is checked at rate 0 on twins of its own (a traced train function keeps
    the rate it was traced with, and the timed twins must drop out as the user's model does)."""

    def __init__(self, ctx, data, batch_size, notes):
        self.ctx, self.data, self.B, self.notes = ctx, data, batch_size, notes
        self.reference = None
        self.skip = _exact.biases_before_batchnorm(ctx.model)
        self.own_twins = _exact.has_dropout(ctx.model)
        if data is None:
            notes.append("exactness not checked: no full batch could be read from `x`.")
        elif self.skip:
            notes.append(
                f"{len(self.skip)} bias(es) feeding BatchNormalization left out of the weight "
                "comparison; the model's outputs on a batch are compared instead."
            )

    def _train(self, twin):
        if self.own_twins:
            _exact.no_dropout(twin)
        _exact.train_twin(twin, self.data, self.B)

    def check(self, candidate, twin):
        """(exact, max_abs_diff) of `candidate` with `twin`, not yet fitted; (None, None)
        where not checked. The baseline (`{}` settings) becomes the reference: (True, 0.0)."""
        if self.data is None:
            return None, None
        is_base = not candidate.settings
        if not is_base and (not candidate.exact_lever or self.reference is None):
            return None, None
        try:
            if self.own_twins:
                twin = self.ctx.twins.make(self.ctx, candidate, role="check")
            self._train(twin)
            if is_base:
                self.reference = _exact.Snapshot(twin, self.data, self.B, self.skip)
                return True, 0.0
        except Exception as e:  # noqa: BLE001 - listed, not fatal
            if is_base:
                self.notes.append(f"exactness not checked: the reference failed: {e}"[:200])
            else:
                self.notes.append(f"exactness of {candidate.name} not checked: {e}"[:200])
            return None, None
        ok, diff = _exact.compare(self.reference, twin, self.data, self.B, self.skip)
        return ok, float(np.float64(diff))

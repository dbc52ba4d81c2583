"""`PruningCallback`: magnitude pruning during `fit`, on the model as it is."""

from __future__ import annotations

import weakref

import keras
from keras import ops

from keras_perf._layer_selection import (
    check_selectors,
    deserialize_selectors,
    serialize_selectors,
)
from keras_perf._tensorboard import ScalarWriter, require_writer
from keras_perf._utils import check_choice, check_int, warn
from keras_perf.pruning._base import MaskingCallback
from keras_perf.pruning._constraint import (
    _apply_masks,
    _guard_set_weights,
    _install,
    _mask_sparsity,
)
from keras_perf.pruning._masks import _check_m_by_n, _compute_masks
from keras_perf.pruning._schedules import ConstantSparsity, PolynomialDecay, _as_schedule
from keras_perf.pruning._selection import _relative_path, _select, _Target


@keras.saving.register_keras_serializable(package="keras_perf", name="PruningCallback")
class PruningCallback(MaskingCallback):
    """Magnitude pruning during `fit`, on the model as it is: no wrapping or recompiling.

    At the first epoch the callback finds the prunable weights (tfmot's defaults: kernels of
    Dense, EinsumDense (so MultiHeadAttention projections), Conv*, Conv*Transpose, the
    pointwise kernels of SeparableConv*, Embedding embeddings, RNN cell kernel and
    recurrent_kernel; never biases, normalisation or non-trainable weights), in Sequential,
    Functional, subclassed and nested models alike. Each gets a 0/1 mask in a non-trainable
    variable, installed as the weight's constraint, which Keras' optimizer applies inside the
    compiled step after every update: pruned entries stay exactly zero whatever the optimizer.

    The step is the optimizer's iteration count at the start of the batch (read once per
    epoch, counted in Python in between). tfmot counts batches per wrapped layer from 0 when
    the wrapped model starts training; the two agree whenever the optimizer is fresh when
    pruning starts. When the schedule says so, the masks are recomputed before that step runs:
    per weight (`scope="layer"`, tfmot's rule: keep the k = max(round(n * (1 - s)), 1) largest
    magnitudes), with one threshold over all weights (`scope="global"`), or in m-by-n blocks.

    Resuming: nothing is stored in the model. The saved weights carry the zeros, and when the
    optimizer's step shows the schedule has already pruned, the masks are rebuilt from them,
    so `model.save`/`load_model` and `keras.callbacks.BackupAndRestore` continue with the same
    pattern. `state_dict()`/`load_state_dict()` carry the masks explicitly as well.

    Restored weights: `EarlyStopping`/`TimeLimit` with `restore_best_weights=True` put back an
    earlier epoch's weights with `model.set_weights`. While masks are installed, a pruned
    model's `set_weights` masks what it sets with the *latest* masks, so after `fit` the model
    has the sparsity logged last (`history["sparsity"][-1]`) and every pruned entry is zero.

    At the first epoch, when `fit` knows its length, a warning says if this fit ends before
    the schedule reaches its target (e.g. `end_step` beyond the planned steps), with the
    numbers: steps planned, `end_step`, and the sparsity the last mask update will reach.

    A model Keras builds only in its first train step (a subclassed model never called before
    `fit`, on TensorFlow) has no weights before that step: its masks are installed right
    after it, and a mask update due at that first step runs then.

    Logs `sparsity` (the fraction of pruned entries over all target weights) in the epoch logs;
    a `keras.callbacks.TensorBoard` placed after this callback records it as a scalar, and
    `log_dir` writes per-weight sparsity at every mask update.

    Args:
        schedule: When and how much to prune: `kp.PolynomialDecay`, `kp.ConstantSparsity`, a
            tfmot schedule (converted) or any callable `step -> (should_prune, sparsity)`.
        scope: `"layer"` (a threshold per weight, as tfmot) or `"global"` (one threshold
            across all target weights, so layers end with different sparsities).
            Defaults to `"layer"`.
        m_by_n: `None`, or `(m, n)`: zero the m smallest of every n consecutive entries along
            the input dimension (tfmot's `sparsity_m_by_n`; `(2, 4)` keeps 2 of 4). Axis per
            kind: Dense and RNN kernels axis 0 (inputs), Conv* axis -2 (input channels),
            Conv*Transpose axis -1, SeparableConv pointwise axis -2, Embedding axis -1,
            EinsumDense the last contracted kernel axis. The schedule's sparsity is then
            ignored; it only says when to recompute. Defaults to `None`.
        include: Prune only these: layer names, regexes (fully matching a layer name or a
            weight path) or layer classes; a match on an enclosing layer or sub-model selects
            everything prunable inside it. Defaults to `None` (everything prunable).
        exclude: Leave these out (same forms as `include`). Defaults to `None`.
        verbose: 1 prints a line at each mask update. Defaults to `0`.
        log_dir: Directory for TensorBoard scalars `pruning/sparsity`,
            `pruning/target_sparsity` and `pruning/<weight path>` at each mask update
            (TensorFlow, else tensorboardX: the `tensorboard` extra). Defaults to `None`.

    Raises:
        ImportError: `log_dir` given but neither TensorFlow nor tensorboardX is installed.
        ValueError: bad `scope`, `m_by_n`, `verbose`; at the start of `fit`: a model without
            prunable weights, an `include` or `exclude` item that matches none (the message
            lists them), a model without an optimizer, or a second PruningCallback on the same
            model in the same `fit` (the message names both).
        TypeError: a `schedule` that is not a schedule, bad `include`/`exclude` items.

    Example:

    >>> model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
    ...                           keras.layers.Dense(10)])
    >>> model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> pruning = kp.PruningCallback(kp.PolynomialDecay(0.0, 0.8, 0, 10, frequency=5))
    >>> x, y = np.random.rand(64, 64), np.random.randint(0, 10, 64)
    >>> history = model.fit(x, y, batch_size=8, epochs=2, callbacks=[pruning], verbose=0)
    >>> round(history.history["sparsity"][-1], 2)
    0.8
    """

    def __init__(
        self,
        schedule,
        scope: str = "layer",
        m_by_n: tuple[int, int] | None = None,
        include=None,
        exclude=None,
        verbose: int = 0,
        log_dir: str | None = None,
    ):
        super().__init__()
        self.schedule = _as_schedule(schedule)
        self.scope = check_choice("scope", scope, ("layer", "global"))
        self.m_by_n = _check_m_by_n(m_by_n)
        if self.m_by_n is not None and self.scope == "global":
            raise ValueError(
                "`m_by_n` prunes inside each block of every weight; it cannot be combined with "
                '`scope="global"`. Pass `scope="layer"` (the default).'
            )
        self.include = check_selectors("include", include)
        self.exclude = check_selectors("exclude", exclude)
        self.verbose = check_int("verbose", verbose, minimum=0)
        if log_dir is not None and not isinstance(log_dir, str):
            raise TypeError(f"`log_dir` must be None or a directory path; got {log_dir!r}.")
        if log_dir is not None:
            require_writer("PruningCallback(log_dir=...)")  # TensorFlow, else tensorboardX
        self.log_dir = log_dir
        self.targets: list[_Target] = []
        self.history: list[dict] = []
        self.sparsity = 0.0
        self.thresholds: dict = {}
        self._targets_model = None
        self._ready = False
        self._pending_state: dict | None = None
        self._writer = None
        self._plan_checked = False
        self._missed = None

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Pruning state: the step, the overall sparsity, and each weight's mask.

        Masks are keyed by weight path without the model's name (`"hidden/kernel"`), so the
        state loads into a rebuilt or reloaded copy of the model.
        """
        return {
            "step": self._step,
            "sparsity": self.sparsity,
            "masks": {
                _relative_path(self._targets_model, t): ops.convert_to_numpy(t.mask.value)
                for t in self.targets
                if t.mask is not None
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; masks are installed at the next `fit`'s first epoch."""
        self._pending_state = dict(state)
        self.sparsity = float(state.get("sparsity", 0.0))
        self._step = int(state.get("step", 0))

    def get_config(self) -> dict:
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "scope": self.scope,
            "m_by_n": list(self.m_by_n) if self.m_by_n else None,
            "include": serialize_selectors(self.include),
            "exclude": serialize_selectors(self.exclude),
            "verbose": self.verbose,
            "log_dir": self.log_dir,
        }

    @classmethod
    def from_config(cls, config: dict):
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        config["include"] = deserialize_selectors(config.get("include"))
        config["exclude"] = deserialize_selectors(config.get("exclude"))
        if config.get("m_by_n") is not None:
            config["m_by_n"] = tuple(config["m_by_n"])
        return cls(**config)

    def __repr__(self) -> str:
        args = [repr(self.schedule), f"scope={self.scope!r}"]
        for name in ("m_by_n", "include", "exclude"):
            if getattr(self, name):
                args.append(f"{name}={getattr(self, name)!r}")
        return f"PruningCallback({', '.join(args)})"

    # -- hooks --------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        model = self._model
        if getattr(model, "optimizer", None) is None:
            raise ValueError("PruningCallback needs a compiled model (it counts optimizer steps).")
        self._claim(model)
        # An unbuilt model (subclassed, never called) is built by Keras before this hook on
        # JAX and torch, but only inside the first train step on TensorFlow: its weights are
        # found as soon as they exist (see `on_train_batch_begin`).
        if model.built and self._targets_model is not model:
            self.targets = _select(model, self.include, self.exclude)
            self._targets_model = model
        _guard_set_weights(model)
        self._read_steps_per_execution(model)
        self.history = []
        self._ready = False
        self._plan_checked = False
        self._missed = None

    def set_model(self, model):
        super().set_model(model)
        # Pointed at another model in the middle of a fit (`kp.fit_with_oom_retry` goes on
        # with a `kp.loss_scaled` twin that shares the layers): its `set_weights` masks too,
        # or a best-weights restore through it would bring pruned entries back.
        if self._ready and model is not None:
            _guard_set_weights(model)

    def _claim(self, model) -> None:
        """Refuse a second PruningCallback on the same model in the same `fit`.

        Keras gives every callback of one `fit` the same `params` dict, which tells a second
        callback of this fit from one left over from an earlier (possibly interrupted) fit.
        """
        owner = vars(model).get("_kp_pruning_owner")
        if owner is not None:
            other, params = owner[0](), owner[1]
            if other is not None and other is not self and params is self.params:
                raise ValueError(
                    f"Two PruningCallbacks prune model {model.name!r} in the same fit: "
                    f"{other!r} and {self!r}. Each would overwrite the other's masks (the last "
                    "one silently winning). Pass one PruningCallback per model; to prune "
                    "layers differently, run one fit per phase, or use `include`/`exclude` "
                    "and `scope` of a single callback."
                )
        object.__setattr__(model, "_kp_pruning_owner", (weakref.ref(self), self.params))

    def on_epoch_begin(self, epoch, logs=None):
        model = self.model  # on JAX this attaches the latest state to the variables
        self._read_step(model)
        if not self._plan_checked:
            # At the first epoch: BackupAndRestore has restored the step and epoch by now.
            self._plan_checked = True
            self._check_plan(epoch)
        if not self._ready and model.built:
            self._setup(model, pruned_before=self._pruned_before())

    def _setup(self, model, pruned_before: bool) -> None:
        """Find the weights (if not yet) and install the masks; once per fit."""
        if self._targets_model is not model:
            self.targets = _select(model, self.include, self.exclude)
            self._targets_model = model
        state = self._pending_state or {}
        initial = state.get("masks")
        if initial is not None:
            initial = {t.path: initial[_relative_path(model, t)] for t in self.targets
                       if _relative_path(model, t) in initial}  # fmt: skip
        changed = _install(self.targets, initial, derive_from_zeros=pruned_before)
        self._pending_state = None
        self.sparsity, per = _mask_sparsity(self.targets)
        # JAX: the masks join the optimizer state, so mask updates need no retrace.
        self._carry_masks(model)
        self._refresh_train_step(model, masks_changed=False, constraints_changed=changed)
        self._ready = True

    def _pruned_before(self) -> bool:
        """Whether the schedule has named a prune step before the current step."""
        if isinstance(self.schedule, (ConstantSparsity, PolynomialDecay)):
            return self._step > self.schedule.begin_step
        # Any other schedule: look back over (at most) the last 100k steps.
        return any(self.schedule(s)[0] for s in range(max(0, self._step - 100_000), self._step))

    def _check_plan(self, epoch: int) -> None:
        """Warn when this fit ends before the schedule reaches its target sparsity."""
        schedule, steps, epochs = self.schedule, self.params.get("steps"), self.params.get("epochs")
        if not steps or not epochs or not isinstance(schedule, (PolynomialDecay, ConstantSparsity)):
            return  # unknown length, or a schedule we cannot reason about
        n = (epochs - epoch) * steps
        if n <= 0:
            return
        first, last = self._step, self._step + n - 1
        begin, end, frequency = schedule.begin_step, schedule.end_step, schedule.frequency
        plan = (
            f"this fit runs {n} steps ({epochs - epoch} epochs x {steps}"
            + (f" from epoch {epoch}" if epoch else "")
            + f"), steps {first}-{last}"
        )
        if end != -1 and first > end:
            return  # pruning ended before this fit: fine-tuning
        if begin > last:
            warn(
                f"PruningCallback: no mask update in this fit: {plan}, but begin_step={begin}. "
                "Nothing will be pruned; lower `begin_step` or train for more steps."
            )
            return
        if isinstance(schedule, ConstantSparsity):
            return
        last_prune = begin + ((min(end, last) - begin) // frequency) * frequency
        reached, target = schedule(last_prune)[1], schedule(end)[1]
        if last_prune >= end or reached == target:
            return
        why = (
            f"but the schedule's end_step={end} lies beyond them"
            if end > last
            else f"but end_step={end} is not begin_step={begin} plus a multiple of "
            f"frequency={frequency}"
        )
        warn(
            f"PruningCallback: the schedule will not reach its target: {plan}, {why}: the last "
            f"mask update, at step {last_prune}, prunes to {reached:.4f}, not "
            f"final_sparsity={schedule.final_sparsity!r}. Set `end_step` <= {last} (and equal "
            "to `begin_step` plus a multiple of `frequency`), or train for more steps."
        )

    def _on_step(self, due) -> None:
        if not self._ready:
            # TensorFlow builds an unbuilt model inside its first train step: no weights to
            # prune before it. A prune step due then runs as soon as the weights exist.
            if not self._model.built:
                self._missed = due or self._missed
                return
            self._setup(self.model, pruned_before=False)
            due = due or self._missed
            self._missed = None
        super()._on_step(due)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["sparsity"] = self.sparsity

    def on_train_end(self, logs=None):
        if not self._ready and self._model.built and self._missed is not None:
            # A one-batch fit of a model built in that batch (TensorFlow): prune now.
            self._setup(self.model, pruned_before=False)
            self._update(*self._missed)
            self._missed = None
        # Weight EMA (`use_ema=True`) overwrites the weights after the last step: mask again.
        if self._ready:
            model = self.model  # on JAX this attaches the latest state to the variables
            _apply_masks(self.targets)
            self._release_masks(model)

    def _mask_variables(self) -> list:
        return [t.mask for t in self.targets]

    # -- mask update --------------------------------------------------------------------------
    def _update(self, step: int, target_sparsity: float) -> None:
        model = self.model  # on JAX this attaches the latest state to the variables
        masks, thresholds = _compute_masks(self.targets, target_sparsity, self.scope, self.m_by_n)
        _apply_masks(self.targets, masks)
        self.sparsity, per = _mask_sparsity(self.targets)
        if thresholds is not None:
            self.thresholds = {
                t.path: float(ops.convert_to_numpy(th)) for t, th in zip(self.targets, thresholds)
            }
        self.history.append(
            {"step": step, "target_sparsity": target_sparsity, "sparsity": self.sparsity}
        )
        self._refresh_train_step(model, masks_changed=True, constraints_changed=False)
        if self.verbose:
            print(
                f"PruningCallback: step {step}: target sparsity {target_sparsity:.4f}, "
                f"pruned {self.sparsity:.4f} of {len(self.targets)} weights"
            )
        if self.log_dir:
            self._write_summaries(step, target_sparsity, per)

    def _write_summaries(self, step, target_sparsity, per) -> None:
        if self._writer is None:
            self._writer = ScalarWriter(self.log_dir)  # keras_perf/_tensorboard.py
        self._writer.scalar("pruning/sparsity", self.sparsity, step)
        self._writer.scalar("pruning/target_sparsity", target_sparsity, step)
        for path, value in per.items():
            self._writer.scalar(f"pruning/{path}", value, step)
        self._writer.flush()

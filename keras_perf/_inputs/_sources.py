"""The user's training data, as `fit` takes it, behind one interface (`diagnose`, `accelerate`).

A `Source` answers three questions the measurements ask: what to pass to `fit` to train on the
user's own data and settings (`fit_kwargs`), how long pulling batches takes by itself (`take`),
and which batches to keep in memory for timing the step alone. Inputs `fit` can restart
(arrays, `tf.data`, `PyDataset`, a torch `DataLoader`) are read again for each measurement; a
one-pass input (a generator or iterator) is read once, at most `steps` batches.
"""

from __future__ import annotations

import inspect
import itertools
import time

import keras
import numpy as np

from keras_perf import backend as _backend
from keras_perf._inputs._kinds import KERAS_DEFAULT_BATCH, is_array_input, module_of
from keras_perf._utils import first_tensor


def _to_numpy(batch):
    return keras.tree.map_structure(lambda t: np.asarray(keras.ops.convert_to_numpy(t)), batch)


def _leading(batch) -> int | None:
    x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    try:
        return int(first_tensor(x).shape[0])
    except (TypeError, AttributeError, IndexError, StopIteration):
        return None


class Source:
    """The user's data. Subclasses set `kind`, `one_pass`, `batch_size`, `batches_per_epoch`."""

    kind = ""
    one_pass = False
    batch_size: int | None = None
    batches_per_epoch: int | None = None  # None: unknown or infinite

    def fit_kwargs(self) -> dict:
        raise NotImplementedError

    def take(self, n: int, deadline: float | None = None) -> tuple[list, float]:
        """Pull up to `n` batches as numpy (fewer past `deadline`); return them and the seconds."""
        out, t0 = [], time.perf_counter()
        iterator = self._iterate()
        for batch in itertools.islice(iterator, n):
            out.append(_to_numpy(batch))
            if deadline is not None and time.perf_counter() > deadline and len(out) >= 2:
                break
        return out, time.perf_counter() - t0

    def _iterate(self):
        raise NotImplementedError


class ArraySource(Source):
    kind = "arrays"

    def __init__(self, x, y, batch_size, caller="diagnose", model=None):
        self.x, self.y = x, y
        self.model = model  # the model the fits train a twin of (its tf.distribute strategy)
        self.batch_size = batch_size or KERAS_DEFAULT_BATCH
        n = int(first_tensor(x).shape[0])
        for name, part in (("y", y),):
            if part is None:
                continue
            for leaf in keras.tree.flatten(part):
                if int(leaf.shape[0]) != n:
                    raise ValueError(
                        f"{caller}: `x` has {n} examples but `{name}` has {int(leaf.shape[0])}; "
                        "fit needs the same number in both."
                    )
        for leaf in keras.tree.flatten(x):
            if int(leaf.shape[0]) != n:
                raise ValueError(
                    f"{caller}: the arrays in `x` differ in length ({n} and {int(leaf.shape[0])})."
                )
        if n < 1:
            raise ValueError(f"{caller}: `x` holds no examples.")
        self.examples = n
        self.batches_per_epoch = max(n // self.batch_size, 1)
        self._fit_kwargs: dict = {}

    def fit_kwargs(self, batch_size=None) -> dict:
        size = batch_size or self.batch_size
        if size not in self._fit_kwargs:  # one pipeline per batch size, reused by every fit
            self._fit_kwargs[size] = _backend.array_fit_kwargs(
                self.model, self.x, self.y, None, size
            )
        return dict(self._fit_kwargs[size])

    def _iterate(self):
        # What fit does per batch on JAX and torch (on TF its tf.data pipeline does the same).
        order = np.random.default_rng(0).permutation(self.examples)
        b = self.batch_size
        for start in range(0, self.examples - b + 1, b):
            idx = np.sort(order[start : start + b])
            take = lambda a, idx=idx: np.asarray(keras.ops.convert_to_numpy(a))[idx]  # noqa: E731
            xb = keras.tree.map_structure(take, self.x)
            yield xb if self.y is None else (xb, keras.tree.map_structure(take, self.y))


class RestartableSource(Source):
    """tf.data, PyDataset, torch DataLoader: batched already; each `fit` call restarts them."""

    def __init__(self, x, kind):
        self.x, self.kind = x, kind
        self.batches_per_epoch = _length(x, kind)
        self.batch_size = None  # read from the first batch pulled

    def fit_kwargs(self) -> dict:
        return {"x": self.x}

    def _iterate(self):
        if self.kind == "PyDataset":
            n = self.batches_per_epoch
            return (self.x[i] for i in (range(n) if n is not None else itertools.count()))
        return iter(self.x)


class OnePassSource(Source):
    """A generator or iterator: read once through a recorder capped at `limit` batches."""

    kind = "generator"
    one_pass = True

    def __init__(self, x, limit):
        self._it = itertools.islice(iter(x), limit)
        self.limit = limit
        self.recorded: list = []
        self.pull_seconds = 0.0

    def recorder(self):
        """A generator over the user's input that keeps each batch (numpy) and times `next`."""
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(self._it)
            except StopIteration:
                return
            self.pull_seconds += time.perf_counter() - t0
            self.recorded.append(_to_numpy(batch))
            yield batch


def _length(x, kind) -> int | None:
    if kind == "tf.data":
        n = int(x.cardinality())
        return n if n >= 0 else None  # -1 infinite, -2 unknown
    try:
        return int(len(x))
    except TypeError:
        return None


def make_source(x, y, batch_size, steps, caller="diagnose", model=None) -> Source:
    """Sort the data into one of the kinds fit takes; raise what fit would raise, early, naming
    `caller` (the tool)."""
    if x is None:
        raise ValueError(f"{caller}: `x` is None; pass the data you give `model.fit`.")
    batched = None
    if isinstance(x, keras.utils.PyDataset):
        batched = "PyDataset"
    elif inspect.isgenerator(x) or (hasattr(x, "__next__") and iter(x) is x):
        # Before tf.data: `iter(dataset)` has an `element_spec` too, but is read once.
        batched = "generator"
    elif module_of(x).startswith("tensorflow") and hasattr(x, "element_spec"):
        batched = "tf.data"
    elif module_of(x).startswith("torch.utils.data"):
        batched = "DataLoader"
    if batched is not None:
        if y is not None:
            raise ValueError(
                f"{caller}: `y` must be None when `x` is a {batched} (it yields the targets "
                f"itself), as in fit; got `y` of type {type(y).__name__}."
            )
        if batch_size is not None:
            raise ValueError(
                f"{caller}: `batch_size` must be None when `x` is a {batched} (it yields batches "
                f"already), as in fit; got {batch_size!r}."
            )
        if batched == "generator":
            return OnePassSource(x, steps)
        source = RestartableSource(x, batched)
        if source.batches_per_epoch == 0:
            raise ValueError(f"{caller}: the {batched} `x` is empty.")
        return source
    if isinstance(x, (str, bytes)) or not is_array_input(x):
        raise TypeError(
            f"{caller}: `x` must be what `fit` takes: NumPy arrays or tensors (or a dict/list of "
            "them), a tf.data.Dataset, a keras.utils.PyDataset, a torch DataLoader or a "
            f"generator; got {type(x).__name__}."
        )
    if y is not None and not is_array_input(y):
        raise TypeError(f"{caller}: `y` must be arrays like `x`; got {type(y).__name__}.")
    return ArraySource(x, y, batch_size, caller, model)


def stack(batches: list, batch_size: int):
    """The full-size batches of `batches` concatenated into (x, y, sample_weight) arrays."""
    full = [b for b in batches if _leading(b) == batch_size]
    if not full:
        return None
    parts = [keras.utils.unpack_x_y_sample_weight(b) for b in full]
    joined = []
    for i in range(3):
        items = [p[i] for p in parts]
        if items[0] is None:
            joined.append(None)
        else:
            joined.append(keras.tree.map_structure(lambda *a: np.concatenate(a), *items))
    return tuple(joined), len(full)


def leading_dim(batch) -> int | None:
    return _leading(batch)

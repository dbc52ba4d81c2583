"""Bare-framework floors of bench_remat.py: per-layer gradient checkpointing written directly.

`floor_step(name, x, y, remat)` returns a callable running one training step (softmax
cross-entropy on logits, Adam 1e-3) of bench_remat's deep MLP (`name="mlp"`: 512 inputs,
16 x Dense(512, exact gelu), Dense(10); `mlp=(depth, width)` for another size, the inputs
`width` wide, as bench_remat's `--smoke` builds it) or Transformer encoder (`"transformer"`: sequence 128,
d=256, 4 heads of 64, feed-forward 1024 with exact gelu, post-norm, 2 blocks, mean over the
sequence, Dense(10)) on the bare backend picked by KERAS_BACKEND, with each layer checkpointed
(`remat=True`) or not:

- TensorFlow: `tf.recompute_grad` around each layer, in a `tf.function` with `GradientTape`;
- JAX: `jax.checkpoint` around each layer, in `jax.jit` of `jax.value_and_grad` and Adam;
- PyTorch: `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` around each layer,
  eager, `torch.optim.Adam`.

"Each layer" is what `remat="full"` wraps in the Keras model: every Dense, every
MultiHeadAttention whole, every LayerNormalization, the pooling; the residual additions are
outside any checkpoint. Layers are written as Keras computes them (Dense `h @ kernel + bias`,
attention's query scaled by 1/8 before the scores, LayerNormalization with epsilon 1e-3, torch's `layer_norm` kernel on torch as Keras
calls it).

`floor_memory(name, x, y, remat)` counts one step with the measure bench_remat uses on the
backend (benchmarks/_memory.py): TensorFlow's BFC allocator peak during one call of the traced
step above the bytes in use before (TF_CPU_ALLOCATOR_USE_BFC must be set before TensorFlow is
imported, as _memory.py does); XLA's temp buffers of the compiled step (not donated, as
_memory.py compiles Keras' step); the peak of the tensors torch's autograd saves for backward
(weights and data not counted). bench_remat reads activation memory from these counts as it
reads its own: growth per example between two batches on TF and JAX, bytes per example on torch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._floors import B1, B2, EPS, LR, _jax_adam, _tf_adam

NAMES = ("mlp", "transformer")
# Input shape of one example, per model.
SHAPES = {"mlp": (512,), "transformer": (128, 256)}
# The MLP's (depth, width) by default: 16 x Dense(512) on 512 inputs.
MLP = (16, 512)
HEADS, KEY_DIM, D, FF, BLOCKS, LN_EPS = 4, 64, 256, 1024, 2, 1e-3


def _params(name: str, mlp: tuple[int, int] = MLP) -> list[np.ndarray]:
    """The weights, flat, in the order `_forward` reads them (He-like normal init); `mlp`: the
    MLP's (depth, width)."""
    rng = np.random.default_rng(0)

    def w(*shape, fan_in):
        return rng.normal(0, (1.0 / fan_in) ** 0.5, shape).astype("float32")

    def z(*shape):
        return np.zeros(shape, "float32")

    if name == "mlp":
        depth, width = mlp
        sizes = [width] + [width] * depth + [10]
        return [p for a, b in zip(sizes, sizes[1:]) for p in (w(a, b, fan_in=a), z(b))]
    out = []
    for _ in range(BLOCKS):
        for _ in range(3):  # query, key, value
            out += [w(D, HEADS, KEY_DIM, fan_in=D), z(HEADS, KEY_DIM)]
        out += [w(HEADS, KEY_DIM, D, fan_in=HEADS * KEY_DIM), z(D)]
        out += [np.ones(D, "float32"), z(D)]  # LayerNormalization
        out += [w(D, FF, fan_in=D), z(FF), w(FF, D, fan_in=FF), z(D)]
        out += [np.ones(D, "float32"), z(D)]
    return out + [w(D, 10, fan_in=D), z(10)]


class _Ops:
    """The few operations the layers need, on one backend's tensors."""

    def __init__(self, backend: str):
        if backend == "tensorflow":
            import tensorflow as tf

            self.einsum, self.softmax = tf.einsum, tf.nn.softmax
            self.gelu = lambda x: tf.nn.gelu(x, approximate=False)
            self.mean = lambda x, axis, keep=False: tf.reduce_mean(x, axis, keepdims=keep)
            self.rsqrt = tf.math.rsqrt
        elif backend == "jax":
            import jax
            import jax.numpy as jnp

            self.einsum, self.softmax = jnp.einsum, jax.nn.softmax
            self.gelu = lambda x: jax.nn.gelu(x, approximate=False)
            self.mean = lambda x, axis, keep=False: jnp.mean(x, axis, keepdims=keep)
            self.rsqrt = jax.lax.rsqrt
        else:
            import torch

            self.einsum = torch.einsum
            self.softmax = lambda x: torch.softmax(x, -1)
            self.gelu = torch.nn.functional.gelu
            self.mean = lambda x, axis, keep=False: torch.mean(x, axis, keepdim=keep)
            self.rsqrt = torch.rsqrt
            # torch's own kernel, which Keras' LayerNormalization calls on torch too.
            self.layer_norm = lambda h, gamma, beta: torch.nn.functional.layer_norm(
                h, h.shape[-1:], gamma, beta, LN_EPS
            )

    def dense(self, h, w, b, act=False):
        z = (h @ w if len(h.shape) == 2 else self.einsum("bsi,ij->bsj", h, w)) + b
        return self.gelu(z) if act else z

    def attention(self, h, wq, bq, wk, bk, wv, bv, wo, bo):
        q = (self.einsum("bsi,ihd->bshd", h, wq) + bq) * (1.0 / KEY_DIM**0.5)
        k = self.einsum("bsi,ihd->bshd", h, wk) + bk
        v = self.einsum("bsi,ihd->bshd", h, wv) + bv
        p = self.softmax(self.einsum("bthd,bshd->bhst", k, q))
        return self.einsum("bshd,hdo->bso", self.einsum("bhst,bthd->bshd", p, v), wo) + bo

    def layer_norm(self, h, gamma, beta):
        m = self.mean(h, -1, True)
        c = h - m
        return c * self.rsqrt(self.mean(c * c, -1, True) + LN_EPS) * gamma + beta


def _forward(name: str, ops: _Ops, ws, x, wrap):
    """Logits; `wrap(fn)` returns the layer function `fn(h)` as it is to run (checkpointed or
    not). Each `fn` closes over its weights."""

    def layer(fn, h):
        return wrap(fn)(h)

    if name == "mlp":
        h = x
        for i in range(0, len(ws) - 2, 2):
            h = layer(lambda t, i=i: ops.dense(t, ws[i], ws[i + 1], act=True), h)
        return layer(lambda t: ops.dense(t, ws[-2], ws[-1]), h)
    h, per = x, 16
    for blk in range(BLOCKS):
        p = ws[blk * per : (blk + 1) * per]
        a = layer(lambda t, p=p: ops.attention(t, *p[:8]), h)
        h = layer(lambda t, p=p: ops.layer_norm(t, p[8], p[9]), h + a)
        f = layer(lambda t, p=p: ops.dense(t, p[10], p[11], act=True), h)
        f = layer(lambda t, p=p: ops.dense(t, p[12], p[13]), f)
        h = layer(lambda t, p=p: ops.layer_norm(t, p[14], p[15]), h + f)
    h = layer(lambda t: ops.mean(t, 1), h)
    return layer(lambda t: ops.dense(t, ws[-2], ws[-1]), h)


def _check(name: str) -> None:
    if name not in NAMES:
        raise ValueError(f"`name` must be one of {NAMES}, got {name!r}.")


# ------------------------------------------------------------------------------------------
# TensorFlow
# ------------------------------------------------------------------------------------------
def _tensorflow(name, x, y, remat, mlp=MLP):
    import tensorflow as tf

    ops = _Ops("tensorflow")
    ws, update, _ = _tf_adam(_params(name, mlp))
    xs, ys = tf.constant(x), tf.constant(y)
    wrap = tf.recompute_grad if remat else (lambda fn: fn)

    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            logits = _forward(name, ops, ws, xs, wrap)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(ys, logits))
        update(tape.gradient(loss, ws))
        return loss

    def run():
        return step().numpy()

    def memory():
        run()  # traced and warm
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        run()
        return tf.config.experimental.get_memory_info("CPU:0")["peak"] - base

    return run, memory


# ------------------------------------------------------------------------------------------
# JAX
# ------------------------------------------------------------------------------------------
def _jax(name, x, y, remat, mlp=MLP):
    import jax
    import jax.numpy as jnp

    ops = _Ops("jax")
    wrap = jax.checkpoint if remat else (lambda fn: fn)

    def loss(ws, xb, yb):
        logp = jax.nn.log_softmax(_forward(name, ops, ws, xb, wrap))
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=1))

    grad = jax.value_and_grad(loss)

    def step(state, xb, yb):
        _, g = grad(state[0], xb, yb)
        return _jax_adam(state, g)

    ws = [jnp.asarray(p) for p in _params(name, mlp)]
    state = (ws, [jnp.zeros_like(w) for w in ws], [jnp.zeros_like(w) for w in ws], jnp.float32(0))
    xs, ys = jnp.asarray(x), jnp.asarray(y)
    holder = {}

    def run():
        if "fn" not in holder:  # compiled at the first call only (memory() needs none)
            holder["fn"], holder["state"] = jax.jit(step, donate_argnums=0), state
        holder["state"] = holder["fn"](holder["state"], xs, ys)
        return jax.block_until_ready(holder["state"])

    def memory():
        # From shapes, not donated: as benchmarks/_memory.py compiles Keras' step.
        specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
        lowered = jax.jit(step).lower(specs, xs, ys)
        return int(lowered.compile().memory_analysis().temp_size_in_bytes)

    return run, memory


# ------------------------------------------------------------------------------------------
# PyTorch
# ------------------------------------------------------------------------------------------
def _torch(name, x, y, remat, mlp=MLP):
    import torch
    from torch.utils.checkpoint import checkpoint

    from keras_perf.backend.torch import SavedTensorsPeak

    ops = _Ops("torch")
    ws = [torch.tensor(p, requires_grad=True) for p in _params(name, mlp)]
    opt = torch.optim.Adam(ws, lr=LR, betas=(B1, B2), eps=EPS)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y).long()

    def wrap(fn):
        if not remat:
            return fn
        return lambda h: checkpoint(fn, h, use_reentrant=False)

    def run():
        opt.zero_grad()
        logits = _forward(name, ops, ws, xs, wrap)
        torch.nn.functional.cross_entropy(logits, ys).backward()
        opt.step()

    def memory():
        saved = SavedTensorsPeak(w.untyped_storage().data_ptr() for w in ws)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            run()
        return saved.peak

    return run, memory


def _build(name, x, y, remat, mlp=MLP):
    import keras

    _check(name)
    build = {"tensorflow": _tensorflow, "jax": _jax, "torch": _torch}[keras.backend.backend()]
    return build(name, np.asarray(x, "float32"), np.asarray(y).astype("int32"), remat, mlp)


def floor_step(name: str, x, y, remat: bool, mlp: tuple[int, int] = MLP) -> Callable[[], object]:
    """One training step of the bare-framework model (see the module docstring), warmed up."""
    run, _ = _build(name, x, y, remat, mlp)
    for _ in range(2):  # trace / compile and warm up
        run()
    return run


def floor_memory(name: str, x, y, remat: bool, mlp: tuple[int, int] = MLP) -> int:
    """The backend's byte count of one step at batch `len(x)` (see the module docstring)."""
    _, memory = _build(name, x, y, remat, mlp)
    return int(memory())

"""Bare-framework floors of bench_precision.py's four models, float32 and bfloat16.

`precision_floor(name, x, y, dtype)` returns a callable running one training step (softmax
cross-entropy, Adam 1e-3) of the model `name` ("mlp", "cnn", "transformer", "resnet50"),
written once against a small set of primitives (dense, conv, batch norm, layer norm,
attention, pooling) that each backend implements the way its users write them:

- TensorFlow: `tf.function` + `GradientTape`, NHWC, float32 variables cast to bfloat16 at each
  use (as Keras' mixed policy does); Adam by hand.
- PyTorch: eager, NCHW (torch's own layout), `torch.autocast("cpu", torch.bfloat16)` around
  the forward pass, `F.scaled_dot_product_attention`, `torch.optim.Adam`.
- JAX: `jax.jit` (state donated), NHWC, casts as on TensorFlow; Adam by hand.

The architectures match Keras' (same parameters, biases on ResNet50's convolutions, batch
norm in float32 on bfloat16 inputs as Keras does); what the floors leave out is Keras
itself: layers, autocasting scopes, metrics, `fit`'s loop. Batch norm's moving statistics are
not updated (a few element-wise ops per layer). Logits are float32 before the loss, as the
benchmark models' float32 output layer makes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-7
BN_EPS = 1.001e-5  # keras.applications.ResNet50's
LN_EPS = 1e-3  # keras.layers.LayerNormalization's default


# -- the four models, written once against a primitive set `P` -------------------------------
def mlp(P, x):
    h = P.relu(P.dense(x, "d1", 2048))
    h = P.relu(P.dense(h, "d2", 2048))
    return P.logits(h, "out", 10)


def cnn(P, x):
    h = P.relu(P.conv(x, "c1", 64, 3, 1, "same"))
    h = P.relu(P.conv(h, "c2", 64, 3, 1, "same"))
    h = P.maxpool(h, 2, 2)
    h = P.relu(P.conv(h, "c3", 128, 3, 1, "same"))
    return P.logits(P.gap(h), "out", 10)


def transformer(P, x):
    h = x
    for i in range(2):
        h = P.layer_norm(P.add(h, P.attention(h, f"mha{i}", heads=4, key_dim=64)), f"ln{i}a")
        f = P.dense(P.relu(P.dense(h, f"ff{i}a", 1024)), f"ff{i}b", 256)
        h = P.layer_norm(P.add(h, f), f"ln{i}b")
    return P.logits(P.seq_mean(h), "out", 10)


def resnet50(P, x):
    h = P.conv(P.pad(x, 3), "conv1", 64, 7, 2, "valid")
    h = P.maxpool(P.pad(P.relu(P.bn(h, "conv1_bn")), 1), 3, 2)
    for stage, (filters, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for b in range(blocks):
            stride = 2 if b == 0 and stage > 0 else 1
            name = f"s{stage}b{b}"
            if b == 0:
                short = P.bn(P.conv(h, name + "_0", 4 * filters, 1, stride, "valid"), name + "_0bn")
            else:
                short = h
            y = P.relu(P.bn(P.conv(h, name + "_1", filters, 1, stride, "valid"), name + "_1bn"))
            y = P.relu(P.bn(P.conv(y, name + "_2", filters, 3, 1, "same"), name + "_2bn"))
            y = P.bn(P.conv(y, name + "_3", 4 * filters, 1, 1, "valid"), name + "_3bn")
            h = P.relu(P.add(short, y))
    return P.logits(P.gap(h), "out", 10)


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer, "resnet50": resnet50}


# -- parameters: a pass over shapes ----------------------------------------------------------
class _Shapes:
    """Runs a model on shapes (batch left out, channels last) and creates its parameters in
    numpy, Glorot-uniform kernels and zero biases as Keras' defaults."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.params: dict[str, np.ndarray] = {}

    def _kernel(self, name, shape, fan_in, fan_out):
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        self.params[name] = self.rng.uniform(-limit, limit, shape).astype("float32")

    def _bias(self, name, n, value=0.0):
        self.params[name] = np.full((n,), value, "float32")

    def dense(self, s, name, units):
        self._kernel(name + "/w", (s[-1], units), s[-1], units)
        self._bias(name + "/b", units)
        return (*s[:-1], units)

    logits = dense

    def conv(self, s, name, filters, k, stride, padding):
        self._kernel(name + "/w", (k, k, s[-1], filters), k * k * s[-1], k * k * filters)
        self._bias(name + "/b", filters)
        h, w = s[0], s[1]
        if padding == "valid":
            h, w = h - k + 1, w - k + 1
        return (-(-h // stride), -(-w // stride), filters)

    def bn(self, s, name):
        self._bias(name + "/gamma", s[-1], 1.0)
        self._bias(name + "/beta", s[-1])
        return s

    def layer_norm(self, s, name):
        return self.bn(s, name)

    def attention(self, s, name, heads, key_dim):
        for p in "qkv":
            self.dense(s, f"{name}/{p}", heads * key_dim)
        return self.dense((*s[:-1], heads * key_dim), name + "/o", s[-1])

    def pad(self, s, n):
        return (s[0] + 2 * n, s[1] + 2 * n, s[2])

    def maxpool(self, s, k, stride):
        return ((s[0] - k) // stride + 1, (s[1] - k) // stride + 1, s[2])

    def gap(self, s):
        return (s[-1],)

    seq_mean = gap

    def relu(self, s):
        return s

    def add(self, a, b):
        return a


def parameters(name: str, input_shape) -> dict[str, np.ndarray]:
    """The numpy parameters of model `name` for inputs of `input_shape` (batch left out)."""
    P = _Shapes()
    MODELS[name](P, tuple(input_shape))
    return P.params


# -- TensorFlow and JAX: NHWC, variables cast at each use -------------------------------------
class _Casting:
    """Primitives on `ops` (tf or jax.numpy) computing in `dtype`, parameters cast at use."""

    def __init__(self, ops, params, dtype):
        self.o, self.p, self.dtype = ops, params, dtype

    def w(self, name):
        return self.o.cast(self.p[name], self.dtype)

    def dense(self, x, name, units):
        return self.o.matmul(x, self.w(name + "/w")) + self.w(name + "/b")

    def logits(self, x, name, units):  # the float32 output layer
        x = self.o.cast(x, "float32")
        return self.o.matmul(x, self.p[name + "/w"]) + self.p[name + "/b"]

    def conv(self, x, name, filters, k, stride, padding):
        return self.o.conv(x, self.w(name + "/w"), stride, padding) + self.w(name + "/b")

    def bn(self, x, name):  # training mode, statistics in float32 (as Keras on bfloat16 inputs)
        o = self.o
        xf = o.cast(x, "float32")
        mean, var = o.moments(xf, (0, 1, 2))
        y = (xf - mean) * o.rsqrt(var + BN_EPS) * self.p[name + "/gamma"] + self.p[name + "/beta"]
        return o.cast(y, self.dtype)

    def layer_norm(self, x, name):
        o = self.o
        xf = o.cast(x, "float32")
        mean, var = o.moments(xf, (-1,), keepdims=True)
        y = (xf - mean) * o.rsqrt(var + LN_EPS) * self.p[name + "/gamma"] + self.p[name + "/beta"]
        return o.cast(y, self.dtype)

    def attention(self, x, name, heads, key_dim):
        o = self.o
        b, s = x.shape[0], x.shape[1]

        def split(t):
            return o.transpose(o.reshape(t, (b, s, heads, key_dim)), (0, 2, 1, 3))

        q, k, v = (split(self.dense(x, f"{name}/{p}", 0)) for p in "qkv")
        scores = o.matmul(q, o.transpose(k, (0, 1, 3, 2))) * (1.0 / math.sqrt(key_dim))
        a = o.matmul(o.cast(o.softmax(o.cast(scores, "float32")), self.dtype), v)
        a = o.reshape(o.transpose(a, (0, 2, 1, 3)), (b, s, heads * key_dim))
        return self.dense(a, name + "/o", 0)

    def pad(self, x, n):
        return self.o.pad(x, n)

    def maxpool(self, x, k, stride):
        return self.o.maxpool(x, k, stride)

    def gap(self, x):
        return self.o.reduce_mean(x, (1, 2))

    def seq_mean(self, x):
        return self.o.reduce_mean(x, (1,))

    def relu(self, x):
        return self.o.relu(x)

    def add(self, a, b):
        return a + b


class _TFOps:
    def __init__(self):
        import tensorflow as tf

        self.tf = tf

    def cast(self, x, dtype):
        return self.tf.cast(x, dtype)

    def matmul(self, a, b):
        return self.tf.matmul(a, b) if len(a.shape) != 3 else self.tf.einsum("bsi,io->bso", a, b)

    def conv(self, x, w, stride, padding):
        return self.tf.nn.conv2d(x, w, stride, padding.upper())

    def moments(self, x, axes, keepdims=False):
        return self.tf.nn.moments(x, list(axes), keepdims=keepdims)

    def rsqrt(self, x):
        return self.tf.math.rsqrt(x)

    def transpose(self, x, perm):
        return self.tf.transpose(x, perm)

    def reshape(self, x, shape):
        return self.tf.reshape(x, shape)

    def softmax(self, x):
        return self.tf.nn.softmax(x)

    def pad(self, x, n):
        return self.tf.pad(x, [[0, 0], [n, n], [n, n], [0, 0]])

    def maxpool(self, x, k, stride):
        return self.tf.nn.max_pool2d(x, k, stride, "VALID")

    def reduce_mean(self, x, axes):
        return self.tf.reduce_mean(x, axes)

    def relu(self, x):
        return self.tf.nn.relu(x)


class _JaxOps:
    def __init__(self):
        import jax
        import jax.numpy as jnp

        self.jax, self.jnp = jax, jnp

    def cast(self, x, dtype):
        return x.astype(dtype)

    def matmul(self, a, b):
        return self.jnp.matmul(a, b)

    def conv(self, x, w, stride, padding):
        return self.jax.lax.conv_general_dilated(
            x, w, (stride, stride), padding.upper(), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    def moments(self, x, axes, keepdims=False):
        return self.jnp.mean(x, axes, keepdims=keepdims), self.jnp.var(x, axes, keepdims=keepdims)

    def rsqrt(self, x):
        return self.jax.lax.rsqrt(x)

    def transpose(self, x, perm):
        return self.jnp.transpose(x, perm)

    def reshape(self, x, shape):
        return self.jnp.reshape(x, shape)

    def softmax(self, x):
        return self.jax.nn.softmax(x)

    def pad(self, x, n):
        return self.jnp.pad(x, ((0, 0), (n, n), (n, n), (0, 0)))

    def maxpool(self, x, k, stride):
        lax = self.jax.lax
        return lax.reduce_window(x, -self.jnp.inf, lax.max, (1, k, k, 1), (1, stride, stride, 1),
                                 "VALID")  # fmt: skip

    def reduce_mean(self, x, axes):
        return self.jnp.mean(x, axes)

    def relu(self, x):
        return self.jax.nn.relu(x)


def _tensorflow(model, params, x, y, dtype):
    import tensorflow as tf

    names = sorted(params)
    ws = {n: tf.Variable(params[n]) for n in names}
    ms = {n: tf.Variable(tf.zeros_like(params[n])) for n in names}
    vs = {n: tf.Variable(tf.zeros_like(params[n])) for n in names}
    t = tf.Variable(0.0)
    xs, ys = tf.constant(x), tf.constant(y)
    ops = _TFOps()

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            logits = model(_Casting(ops, ws, dtype), tf.cast(xs, dtype))
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(ys, logits))
        grads = tape.gradient(loss, [ws[n] for n in names])
        t.assign_add(1.0)
        lr = LR * tf.sqrt(1 - B2**t) / (1 - B1**t)
        for n, g in zip(names, grads):
            ms[n].assign_add((g - ms[n]) * (1 - B1))
            vs[n].assign_add((tf.square(g) - vs[n]) * (1 - B2))
            ws[n].assign_sub(lr * ms[n] / (tf.sqrt(vs[n]) + EPS))
        return loss

    return lambda: step().numpy()


def _jax(model, params, x, y, dtype):
    import jax
    import jax.numpy as jnp

    from ._floors import _jax_adam, _jax_runner

    names = sorted(params)
    ops = _JaxOps()

    def loss_fn(ws, xs, ys):
        logits = model(_Casting(ops, dict(zip(names, ws)), dtype), xs.astype(dtype))
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, ys[:, None], axis=1))

    def step(state, xs, ys):
        return _jax_adam(state, jax.grad(loss_fn)(state[0], xs, ys))

    return _jax_runner(step, [params[n] for n in names], x, y)


# -- PyTorch: NCHW, torch.autocast -----------------------------------------------------------
class _Torch:
    """Primitives on torch tensors (NCHW); under autocast, torch picks each op's dtype."""

    def __init__(self, params):
        import torch
        import torch.nn.functional as F

        self.torch, self.F, self.p = torch, F, params

    def dense(self, x, name, units):
        return x @ self.p[name + "/w"] + self.p[name + "/b"]

    def logits(self, x, name, units):
        with self.torch.autocast("cpu", enabled=False):
            return x.float() @ self.p[name + "/w"] + self.p[name + "/b"]

    def conv(self, x, name, filters, k, stride, padding):
        pad = k // 2 if padding == "same" and stride == 1 else 0
        return self.F.conv2d(x, self.p[name + "/w"], self.p[name + "/b"], stride, pad)

    def bn(self, x, name):
        return self.F.batch_norm(x, None, None, self.p[name + "/gamma"], self.p[name + "/beta"],
                                 training=True, eps=BN_EPS)  # fmt: skip

    def layer_norm(self, x, name):
        p = self.p
        return self.F.layer_norm(x, x.shape[-1:], p[name + "/gamma"], p[name + "/beta"], LN_EPS)

    def attention(self, x, name, heads, key_dim):
        b, s = x.shape[0], x.shape[1]

        def split(t):
            return t.reshape(b, s, heads, key_dim).transpose(1, 2)

        q, k, v = (split(self.dense(x, f"{name}/{p}", 0)) for p in "qkv")
        a = self.F.scaled_dot_product_attention(q, k, v)
        return self.dense(a.transpose(1, 2).reshape(b, s, heads * key_dim), name + "/o", 0)

    def pad(self, x, n):
        return self.F.pad(x, (n, n, n, n))

    def maxpool(self, x, k, stride):
        return self.F.max_pool2d(x, k, stride)

    def gap(self, x):
        return x.mean((2, 3))

    def seq_mean(self, x):
        return x.mean(1)

    def relu(self, x):
        return self.torch.relu(x)

    def add(self, a, b):
        return a + b


def _torch(model, params, x, y, dtype):
    import torch

    ps = {}
    for n, v in params.items():
        if v.ndim == 4:  # HWIO -> OIHW
            v = np.ascontiguousarray(v.transpose(3, 2, 0, 1))
        ps[n] = torch.tensor(v, requires_grad=True)
    opt = torch.optim.Adam(ps.values(), lr=LR, betas=(B1, B2), eps=EPS)
    xs = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if x.ndim == 4 else x)
    ys = torch.from_numpy(y).long()
    P = _Torch(ps)

    def run():
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = model(P, xs)
        torch.nn.functional.cross_entropy(logits, ys).backward()
        opt.step()

    return run


def precision_floor(name: str, x: np.ndarray, y: np.ndarray, dtype: str) -> Callable[[], object]:
    """One training step of model `name` on the bare backend of KERAS_BACKEND, in `dtype`
    ("float32" or "bfloat16"), on the fixed batch (x, y); compiled and warmed up."""
    import keras

    if name not in MODELS or dtype not in ("float32", "bfloat16"):
        raise ValueError(f"name in {sorted(MODELS)}, dtype float32/bfloat16; got {name}, {dtype}")
    build = {"tensorflow": _tensorflow, "jax": _jax, "torch": _torch}[keras.backend.backend()]
    run = build(MODELS[name], parameters(name, x.shape[1:]), x, y.astype("int32"), dtype)
    for _ in range(2):
        run()
    return run

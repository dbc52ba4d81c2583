"""Bare-framework floors for the zoo of `bench_accelerate`: an epoch of each model's training
written directly on the backend, without Keras' model or `fit`, the limit a Keras `fit` can reach.

`zoo_floor(name, x, y, batch)` returns a callable that runs ONE EPOCH of training of the zoo model
`name` (a key of `bench_accelerate.ZOO`) on the backend KERAS_BACKEND names: ceil(n / batch)
steps over the data in order, the last batch short when `batch` does not divide n (as `fit`
runs it), each step softmax cross-entropy on the logits (integer labels, mean over the batch) and
Adam 1e-3 with the constants of `_floors` (`LR, B1, B2, EPS`, as `keras.optimizers.Adam`). The
data is split into batches once, up front, and held in the backend's memory (NCHW on torch): an
epoch is the steps alone. The callable is warmed up (each batch shape traced / compiled, run
twice) before it is returned, and waits for its last step.

- JAX: the forward in `jax.numpy` / `jax.nn` / `jax.lax` (convolution by
  `lax.conv_general_dilated` in NHWC, the LSTM by `lax.scan`, attention, layer norm and batch
  norm by hand), one `jax.jit(value_and_grad)` step with its state (weights, Adam's moments, the
  batch-norm moving statistics) donated, Adam as `_floors._jax_adam`.
- TensorFlow: raw `tf` ops (`tf.nn.conv2d` in NHWC, `tf.matmul` / `tf.tensordot`, the LSTM
  unrolled by a Python loop over its 32 steps), one `tf.function(autograph=False)` step with a
  `GradientTape`, Adam as `_floors._tf_adam`.
- PyTorch: native `torch.nn` modules (`nn.Linear`, `nn.Conv2d` / `nn.BatchNorm2d` in NCHW,
  `nn.Embedding`, `nn.LSTM(batch_first=True)`, `nn.MultiheadAttention(batch_first=True)`,
  `nn.LayerNorm`), eager, `torch.optim.Adam(foreach=True)`. With `compiled=True` the module is
  wrapped in `torch.compile(dynamic=False)` (inductor; the backward through AOTAutograd; the loss
  stays eager), as a torch user compiles a model; a model it fails on raises ValueError. Dynamo
  leaves `nn.LSTM` eager (`torch._dynamo.config.allow_rnn` is off by default): the compiled LSTM
  floor compiles the embedding and the head around it.

TF and JAX weights are initialised from numpy (He normal kernels, uniform +-0.05 embeddings,
zero biases); torch modules keep their own initialisation. The floor is timed, not compared.

Each architecture is the Keras builder's layer for layer: the same widths, `MultiHeadAttention(4,
d // 4)` with its query / key / value / output projections and their biases, the residuals,
ReLU, pooling, `use_bias=False` convolutions, "same" padding and strides, layer norm and batch
norm with eps 1e-3, batch norm's moving statistics updated with momentum 0.99 in training. Where
a floor cannot match exactly (the FLOPs are the same up to a bias add):

- torch `nn.LSTM` has two bias vectors (input and recurrent) where Keras' LSTM has one; torch
  `nn.Linear` stores its kernel transposed; the torch CNN flattens in (C, H, W) order.
- torch pads a stride-2 "same" 3x3 convolution symmetrically (1, 1) where Keras (and the TF and
  JAX floors) pad (0, 1): the same output shape and FLOPs, the window shifted by one pixel.
- torch's `BatchNorm2d` updates its moving variance with the unbiased batch variance, Keras with
  the biased one.
- the TF and JAX LSTMs compute the input projection of all 32 steps in one matmul before the
  loop (Keras' cell does it step by step: the same FLOPs); the Keras cell's `unit_forget_bias`
  and orthogonal recurrent kernel are initialisation only.
- the TF floor takes embedding gradients dense (`tf.convert_to_tensor` of the IndexedSlices)
  and runs without XLA (`jit_compile` off), as `_floors.raw_step` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from benchmarks._floors import B1, B2, EPS, LR, _jax_adam, _tf_adam

# The short keys of bench_accelerate's ZOO names (the short keys are accepted too).
KEYS = {
    "MLP 64-256-256-10": "mlp",
    "small CNN 28x28": "cnn",
    "Transformer encoder (2 blocks, d 128, seq 64)": "transformer",
    "LSTM classifier": "lstm",
    "small ResNet + BatchNorm 32x32": "resnet",
    "dict-input model": "dict",
}
D, SEQ, HEADS, VOCAB, FF = 128, 64, 4, 1000, 512  # the Transformer encoder
LSTM_UNITS, LSTM_SEQ = 64, 32
RESNET = ((16, 1), (32, 2), (64, 2))  # (filters, stride) of the ResNet's three blocks
LN_EPS = BN_EPS = 1e-3
BN_MOMENTUM = 0.99


def zoo_floor(
    name: str, x, y: np.ndarray, batch: int, compiled: bool = False
) -> Callable[[], None]:
    """One epoch of training of zoo model `name` on the bare backend (see module docstring).

    `x` is the model's input (a dict of arrays for the dict-input model), `y` integer labels.
    `compiled=True` (torch only) puts the module under `torch.compile`.
    """
    import keras

    key = KEYS.get(name, name)
    if key not in KEYS.values():
        raise ValueError(f"Unknown zoo model {name!r}; expected one of {list(KEYS)}.")
    backend = keras.backend.backend()
    if compiled and backend != "torch":
        raise ValueError("`compiled=True` is for torch (the TF and JAX floors are compiled).")
    inputs = (x["a"], x["b"]) if key == "dict" else (x,)
    y = np.asarray(y).astype("int32")
    parts = [
        (tuple(a[i : i + batch] for a in inputs), y[i : i + batch]) for i in range(0, len(y), batch)
    ]
    if backend == "jax":
        step, batches, sync = _jax(key, parts)
    elif backend == "tensorflow":
        step, batches, sync = _tensorflow(key, parts)
    elif backend == "torch":
        step, batches, sync = _torch(key, parts, compiled)
    else:
        raise ValueError(f"No floor for the {backend!r} backend.")

    # Warm up: trace / compile each batch shape (the full one and a short last one), twice.
    seen = set()
    try:
        for xb, yb in (batches[0], batches[-1]):
            if len(yb) not in seen:
                seen.add(len(yb))
                for _ in range(2):
                    step(xb, yb)
        sync()
    except Exception as e:
        if not compiled:
            raise
        # inductor needs a C++ compiler, and not every op lowers on every machine
        raise ValueError(
            f"torch.compile fails on the {name!r} floor here: {type(e).__name__}: {e}"
        ) from e

    def epoch():
        for xb, yb in batches:
            step(xb, yb)
        sync()

    return epoch


# --- weights (TF and JAX): names and shapes, initialised from numpy ----------------------------


def _dense(name, a, b):
    return [(f"{name}/k", (a, b)), (f"{name}/b", (b,))]


def _norm(name, c):
    return [(f"{name}/gamma", (c,)), (f"{name}/beta", (c,))]


def _spec(key):
    """`(weights, statistics)`: lists of (name, shape) of model `key`'s trainable weights and of
    its batch-norm moving statistics, in a fixed order."""
    stats = []
    if key == "mlp":
        ws = _dense("d0", 64, 256) + _dense("d1", 256, 256) + _dense("d2", 256, 10)
    elif key == "cnn":
        ws = [("c0/k", (3, 3, 1, 16)), ("c0/b", (16,)), ("c1/k", (3, 3, 16, 32)), ("c1/b", (32,))]
        ws += _dense("out", 5 * 5 * 32, 10)
    elif key == "transformer":
        ws = [("embed/emb", (VOCAB, D))]
        for i in range(2):
            for proj in "qkvo":  # MultiHeadAttention(4, d // 4): 4 heads of 32 = d
                ws += _dense(f"t{i}/{proj}", D, D)
            ws += _norm(f"t{i}/ln1", D) + _dense(f"t{i}/f1", D, FF) + _dense(f"t{i}/f2", FF, D)
            ws += _norm(f"t{i}/ln2", D)
        ws += _dense("out", D, 10)
    elif key == "lstm":
        u = LSTM_UNITS
        ws = [("embed/emb", (VOCAB, 64)), ("lstm/k", (64, 4 * u)), ("lstm/r", (u, 4 * u))]
        ws += [("lstm/b", (4 * u,))] + _dense("out", u, 10)
    elif key == "resnet":
        ws, stats = [("stem/k", (3, 3, 3, 16))] + _norm("bn0", 16), _stats("bn0", 16)
        cin = 16
        for i, (f, stride) in enumerate(RESNET):
            ws += [(f"b{i}/c1/k", (3, 3, cin, f))] + _norm(f"b{i}/bn1", f)
            ws += [(f"b{i}/c2/k", (3, 3, f, f))] + _norm(f"b{i}/bn2", f)
            stats += _stats(f"b{i}/bn1", f) + _stats(f"b{i}/bn2", f)
            if stride != 1 or cin != f:
                ws += [(f"b{i}/sc/k", (1, 1, cin, f))]
            cin = f
        ws += _dense("out", cin, 10)
    else:  # dict
        ws = _dense("d0", 32, 64) + _dense("d1", 64 + 8, 10)
    return ws, stats


def _stats(name, c):
    return [(f"{name}/mean", (c,)), (f"{name}/var", (c,))]


def _init(spec, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for name, shape in spec:
        kind = name.rsplit("/", 1)[1]
        if kind in ("b", "beta", "mean"):
            out.append(np.zeros(shape, "float32"))
        elif kind in ("gamma", "var"):
            out.append(np.ones(shape, "float32"))
        elif kind == "emb":
            out.append(rng.uniform(-0.05, 0.05, shape).astype("float32"))
        else:
            fan_in = int(np.prod(shape[:-1]))
            out.append(rng.normal(0, (2.0 / fan_in) ** 0.5, shape).astype("float32"))
    return out


# --- JAX ---------------------------------------------------------------------------------------


def _jax_forward(key):
    """`forward(p, s, *inputs) -> (logits, new_s)`: `p` the weights by name, `s` the moving
    statistics by name (batch norm, training mode)."""
    import jax
    import jax.numpy as jnp

    dn = ("NHWC", "HWIO", "NHWC")

    def dense(p, name, h):
        return h @ p[f"{name}/k"] + p[f"{name}/b"]

    def conv(p, name, h, stride=1, padding="SAME"):
        return jax.lax.conv_general_dilated(
            h, p[f"{name}/k"], (stride, stride), padding, dimension_numbers=dn
        )

    def pool(h):
        return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    def layer_norm(p, name, h):
        mean = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + LN_EPS) * p[f"{name}/gamma"] + p[f"{name}/beta"]

    def batch_norm(p, s, new, name, h):
        mean = jnp.mean(h, (0, 1, 2))
        var = jnp.mean(jnp.square(h - mean), (0, 1, 2))
        for stat, value in (("mean", mean), ("var", var)):
            old = s[f"{name}/{stat}"]
            new[f"{name}/{stat}"] = old * BN_MOMENTUM + jax.lax.stop_gradient(value) * (
                1 - BN_MOMENTUM
            )
        return (h - mean) * jax.lax.rsqrt(var + BN_EPS) * p[f"{name}/gamma"] + p[f"{name}/beta"]

    def attention(p, name, h):
        b, t, d = h.shape

        def heads(v):
            return v.reshape(b, t, HEADS, d // HEADS)

        q = heads(dense(p, f"{name}/q", h)) * (1.0 / math.sqrt(d // HEADS))
        k, v = heads(dense(p, f"{name}/k", h)), heads(dense(p, f"{name}/v", h))
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        return dense(p, f"{name}/o", jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d))

    def forward(p, s, *inputs):
        new = {}
        if key == "mlp":
            h = jax.nn.relu(dense(p, "d0", inputs[0]))
            return dense(p, "d2", jax.nn.relu(dense(p, "d1", h))), new
        if key == "cnn":
            h = inputs[0]
            for name in ("c0", "c1"):
                h = pool(jax.nn.relu(conv(p, name, h, padding="VALID") + p[f"{name}/b"]))
            return dense(p, "out", h.reshape(h.shape[0], -1)), new
        if key == "transformer":
            h = jnp.take(p["embed/emb"], inputs[0], axis=0)
            for i in range(2):
                h = layer_norm(p, f"t{i}/ln1", h + attention(p, f"t{i}", h))
                f = jax.nn.relu(dense(p, f"t{i}/f1", h))
                h = layer_norm(p, f"t{i}/ln2", h + dense(p, f"t{i}/f2", f))
            return dense(p, "out", jnp.mean(h, 1)), new
        if key == "lstm":
            e = jnp.take(p["embed/emb"], inputs[0], axis=0)
            zx = jnp.swapaxes(e @ p["lstm/k"] + p["lstm/b"], 0, 1)  # (time, batch, 4 units)

            def cell(carry, z):
                h, c = carry
                i, f, g, o = jnp.split(z + h @ p["lstm/r"], 4, axis=-1)
                c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
                return (jax.nn.sigmoid(o) * jnp.tanh(c), c), None

            zero = jnp.zeros((e.shape[0], LSTM_UNITS), e.dtype)
            (h, _), _ = jax.lax.scan(cell, (zero, zero), zx)
            return dense(p, "out", h), new
        if key == "resnet":
            h = jax.nn.relu(batch_norm(p, s, new, "bn0", conv(p, "stem", inputs[0])))
            cin = 16
            for i, (f, stride) in enumerate(RESNET):
                r = h
                h = jax.nn.relu(batch_norm(p, s, new, f"b{i}/bn1", conv(p, f"b{i}/c1", h, stride)))
                h = batch_norm(p, s, new, f"b{i}/bn2", conv(p, f"b{i}/c2", h))
                if stride != 1 or cin != f:
                    r = conv(p, f"b{i}/sc", r, stride, "VALID")
                h, cin = jax.nn.relu(h + r), f
            return dense(p, "out", jnp.mean(h, (1, 2))), new
        h = jnp.concatenate([jax.nn.relu(dense(p, "d0", inputs[0])), inputs[1]], -1)
        return dense(p, "d1", h), new

    return forward


def _jax(key, parts):
    import jax
    import jax.numpy as jnp

    spec, stat_spec = _spec(key)
    names = [n for n, _ in spec]
    forward = _jax_forward(key)

    def loss(ws, stats, inputs, yb):
        logits, new = forward(dict(zip(names, ws)), stats, *inputs)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=1)), new

    grad = jax.value_and_grad(loss, has_aux=True)

    def step(state, inputs, yb):
        adam, stats = state
        (_, new), grads = grad(adam[0], stats, inputs, yb)
        return _jax_adam(adam, grads), new

    step = jax.jit(step, donate_argnums=0)
    ws = [jnp.asarray(p) for p in _init(spec)]
    stats = {n: jnp.asarray(v) for (n, _), v in zip(stat_spec, _init(stat_spec))}
    zeros = [jnp.zeros_like(w) for w in ws]
    holder = {"state": ((ws, zeros, [jnp.zeros_like(w) for w in ws], jnp.float32(0)), stats)}
    batches = [(tuple(jnp.asarray(a) for a in xb), jnp.asarray(yb)) for xb, yb in parts]

    def run(xb, yb):
        holder["state"] = step(holder["state"], xb, yb)

    return run, batches, lambda: jax.block_until_ready(holder["state"])


# --- TensorFlow --------------------------------------------------------------------------------


def _tf_forward(key):
    """`forward(p, s, *inputs) -> logits`: `p` the weights by name, `s` the moving statistics'
    variables by name (batch norm, training mode: assigned in place)."""
    import tensorflow as tf

    def dense(p, name, h):
        k = p[f"{name}/k"]
        h = tf.matmul(h, k) if h.shape.rank == 2 else tf.tensordot(h, k, 1)
        return h + p[f"{name}/b"]

    def conv(p, name, h, stride=1, padding="SAME"):
        return tf.nn.conv2d(h, p[f"{name}/k"], stride, padding)

    def layer_norm(p, name, h):
        mean, var = tf.nn.moments(h, [-1], keepdims=True)
        return (h - mean) * tf.math.rsqrt(var + LN_EPS) * p[f"{name}/gamma"] + p[f"{name}/beta"]

    def batch_norm(p, s, name, h):
        mean, var = tf.nn.moments(h, [0, 1, 2])
        for stat, value in (("mean", mean), ("var", var)):
            old = s[f"{name}/{stat}"]
            old.assign(old * BN_MOMENTUM + tf.stop_gradient(value) * (1 - BN_MOMENTUM))
        return tf.nn.batch_normalization(
            h, mean, var, p[f"{name}/beta"], p[f"{name}/gamma"], BN_EPS
        )

    def attention(p, name, h):
        t, d = h.shape[1], h.shape[2]

        def heads(v):
            return tf.reshape(v, (-1, t, HEADS, d // HEADS))

        q = heads(dense(p, f"{name}/q", h)) * (1.0 / math.sqrt(d // HEADS))
        k, v = heads(dense(p, f"{name}/k", h)), heads(dense(p, f"{name}/v", h))
        w = tf.nn.softmax(tf.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        o = tf.reshape(tf.einsum("bhqk,bkhd->bqhd", w, v), (-1, t, d))
        return dense(p, f"{name}/o", o)

    def forward(p, s, *inputs):
        if key == "mlp":
            h = tf.nn.relu(dense(p, "d0", inputs[0]))
            return dense(p, "d2", tf.nn.relu(dense(p, "d1", h)))
        if key == "cnn":
            h = inputs[0]
            for name in ("c0", "c1"):
                h = tf.nn.relu(conv(p, name, h, padding="VALID") + p[f"{name}/b"])
                h = tf.nn.max_pool2d(h, 2, 2, "VALID")
            return dense(p, "out", tf.reshape(h, (-1, 5 * 5 * 32)))
        if key == "transformer":
            h = tf.gather(p["embed/emb"], inputs[0])
            for i in range(2):
                h = layer_norm(p, f"t{i}/ln1", h + attention(p, f"t{i}", h))
                f = tf.nn.relu(dense(p, f"t{i}/f1", h))
                h = layer_norm(p, f"t{i}/ln2", h + dense(p, f"t{i}/f2", f))
            return dense(p, "out", tf.reduce_mean(h, 1))
        if key == "lstm":
            e = tf.gather(p["embed/emb"], inputs[0])
            zx = tf.tensordot(e, p["lstm/k"], 1) + p["lstm/b"]
            h = c = tf.zeros((tf.shape(e)[0], LSTM_UNITS))
            for z in tf.unstack(zx, LSTM_SEQ, axis=1):  # unrolled: 32 steps
                i, f, g, o = tf.split(z + tf.matmul(h, p["lstm/r"]), 4, axis=-1)
                c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
                h = tf.sigmoid(o) * tf.tanh(c)
            return dense(p, "out", h)
        if key == "resnet":
            h = tf.nn.relu(batch_norm(p, s, "bn0", conv(p, "stem", inputs[0])))
            cin = 16
            for i, (f, stride) in enumerate(RESNET):
                r = h
                h = tf.nn.relu(batch_norm(p, s, f"b{i}/bn1", conv(p, f"b{i}/c1", h, stride)))
                h = batch_norm(p, s, f"b{i}/bn2", conv(p, f"b{i}/c2", h))
                if stride != 1 or cin != f:
                    r = conv(p, f"b{i}/sc", r, stride, "VALID")
                h, cin = tf.nn.relu(h + r), f
            return dense(p, "out", tf.reduce_mean(h, [1, 2]))
        h = tf.concat([tf.nn.relu(dense(p, "d0", inputs[0])), inputs[1]], -1)
        return dense(p, "d1", h)

    return forward


def _tensorflow(key, parts):
    import tensorflow as tf

    spec, stat_spec = _spec(key)
    ws, update, t = _tf_adam(_init(spec))
    p = {n: w for (n, _), w in zip(spec, ws)}
    s = {n: tf.Variable(v, trainable=False) for (n, _), v in zip(stat_spec, _init(stat_spec))}
    forward = _tf_forward(key)

    @tf.function(autograph=False)
    def step(inputs, yb):
        with tf.GradientTape() as tape:
            logits = forward(p, s, *inputs)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits))
        # Embedding gradients come as IndexedSlices: taken dense (see module docstring).
        update([tf.convert_to_tensor(g) for g in tape.gradient(loss, ws)])
        return t.read_value()

    batches = [(tuple(tf.constant(a) for a in xb), tf.constant(yb)) for xb, yb in parts]
    last = {}

    def run(xb, yb):
        last["t"] = step(xb, yb)

    return run, batches, lambda: last["t"].numpy()


# --- PyTorch -----------------------------------------------------------------------------------


def _torch_model(key):
    """The zoo model `key` as a `torch.nn.Module` (NCHW images; inputs as positional args)."""
    import torch
    from torch import nn

    if key == "mlp":
        return nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
    if key == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(5 * 5 * 32, 10),
        )  # fmt: skip

    if key == "transformer":

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
                self.ln1, self.ln2 = nn.LayerNorm(D, eps=LN_EPS), nn.LayerNorm(D, eps=LN_EPS)
                self.f1, self.f2 = nn.Linear(D, FF), nn.Linear(FF, D)

            def forward(self, h):
                h = self.ln1(h + self.attn(h, h, h, need_weights=False)[0])
                return self.ln2(h + self.f2(torch.relu(self.f1(h))))

        class Encoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(VOCAB, D)
                self.blocks = nn.Sequential(Block(), Block())
                self.out = nn.Linear(D, 10)

            def forward(self, tokens):
                return self.out(self.blocks(self.embed(tokens)).mean(1))

        return Encoder()

    if key == "lstm":

        class Classifier(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(VOCAB, 64)
                self.lstm = nn.LSTM(64, LSTM_UNITS, batch_first=True)
                self.out = nn.Linear(LSTM_UNITS, 10)

            def forward(self, tokens):
                _, (h, _) = self.lstm(self.embed(tokens))
                return self.out(h[-1])

        return Classifier()

    if key == "resnet":

        def conv_bn(cin, cout, stride):
            # "same" for 3x3: padding 1 (symmetric at stride 2: see module docstring)
            conv = nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False)
            return conv, nn.BatchNorm2d(cout, eps=BN_EPS, momentum=1 - BN_MOMENTUM)

        class Block(nn.Module):
            def __init__(self, cin, f, stride):
                super().__init__()
                self.c1, self.bn1 = conv_bn(cin, f, stride)
                self.c2, self.bn2 = conv_bn(f, f, 1)
                short = stride != 1 or cin != f
                self.sc = nn.Conv2d(cin, f, 1, stride, bias=False) if short else nn.Identity()

            def forward(self, h):
                r = self.bn2(self.c2(torch.relu(self.bn1(self.c1(h)))))
                return torch.relu(r + self.sc(h))

        class ResNet(nn.Module):
            def __init__(self):
                super().__init__()
                self.stem, self.bn0 = conv_bn(3, 16, 1)
                blocks, cin = [], 16
                for f, stride in RESNET:
                    blocks.append(Block(cin, f, stride))
                    cin = f
                self.blocks = nn.Sequential(*blocks)
                self.out = nn.Linear(cin, 10)

            def forward(self, x):
                h = self.blocks(torch.relu(self.bn0(self.stem(x))))
                return self.out(h.mean((2, 3)))

        return ResNet()

    class DictInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.d0, self.d1 = nn.Linear(32, 64), nn.Linear(64 + 8, 10)

        def forward(self, a, b):
            return self.d1(torch.cat([torch.relu(self.d0(a)), b], -1))

    return DictInput()


def _torch(key, parts, compiled):
    import torch
    import torch.nn.functional as F

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = _torch_model(key).to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=(B1, B2), eps=EPS, foreach=True)
    forward = torch.compile(model, dynamic=False) if compiled else model

    def tensor(a):
        if key in ("cnn", "resnet"):
            a = np.ascontiguousarray(a.transpose(0, 3, 1, 2))  # NHWC -> NCHW, once
        elif a.dtype.kind in "iu":
            a = a.astype("int64")
        return torch.from_numpy(a).to(device)

    batches = [
        (tuple(tensor(a) for a in xb), torch.from_numpy(yb.astype("int64")).to(device))
        for xb, yb in parts
    ]

    def run(xb, yb):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(forward(*xb), yb).backward()
        opt.step()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    return run, batches, sync

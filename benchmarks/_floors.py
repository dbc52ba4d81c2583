"""Hand-written training steps on the bare framework: the floor a Keras-level step sits on.

`raw_step(x, y, slices, check)` returns a callable that runs one training step of an MLP
(784-1024-1024-10 by default, ReLU, softmax cross-entropy, Adam 1e-3) written the way a user of
the backend would write it, without Keras' model or `fit`: TensorFlow `tf.function` +
`GradientTape`, JAX `jax.jit` + `jax.grad`, PyTorch eager + `torch.optim.Adam`. Every backend
computes each layer as `h @ kernel + bias` with the kernel stored (inputs, outputs), as Keras'
`Dense` does.

- `slices=k` splits the batch into k equal slices and sums their gradients before one update
  (hand-written gradient accumulation), as `microbatches=k` does.
- `check=True` adds what the non-finite skip needs: the global gradient norm, and the update
  applied only if it is finite.

The ratios of these callables (4 slices / 1, checked / unchecked) say what the same work costs
on the framework alone, so a Keras-level ratio can be read against it.

Two more floors answer narrower questions:

- `raw_cnn_step(x, y, slices)` (JAX): the benchmark's small CNN (conv 16, pool, conv 32, pool,
  dense 10) written in bare JAX, its slices accumulated inside `jax.lax.scan` (one slice's
  activations alive at a time, as `microbatches` does) or, with `loop="unrolled"`, in a Python
  loop. It shows what XLA:CPU makes of convolution gradients inside a loop body.
- `keras_loop_step(model, x, y, slices)` (PyTorch): gradient accumulation written by hand around
  a compiled Keras model (`model(x)`, `model.compute_loss`, `backward()` per slice, one
  `optimizer.apply`): what any accumulation through Keras' eager layers costs on torch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-7


def _params(sizes, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for a, b in zip(sizes, sizes[1:]):
        out.append(rng.normal(0, (2.0 / a) ** 0.5, (a, b)).astype("float32"))
        out.append(np.zeros((b,), "float32"))
    return out


def raw_step(
    x: np.ndarray,
    y: np.ndarray,
    slices: int = 1,
    check: bool = False,
    sizes=(784, 1024, 1024, 10),
    device: str | None = None,
    compiled: bool = False,
) -> Callable[[], object]:
    """One training step on the bare backend picked by KERAS_BACKEND (see module docstring).

    torch only: `device` places the weights and the batch (default the CPU; the call waits for
    a CUDA device's work) and `compiled=True` runs the forward pass under `torch.compile`, as
    the GPU kit's accelerate rows do.
    """
    import keras

    backend = keras.backend.backend()
    if len(x) % slices:
        raise ValueError(f"`slices` ({slices}) must divide the batch ({len(x)}).")
    if (device is not None or compiled) and backend != "torch":
        raise ValueError("`device` and `compiled` are for torch (TF and JAX place and compile).")
    params = _params(list(sizes))
    if backend == "torch":
        run = _torch(x, y.astype("int32"), slices, check, params, device, compiled)
    else:
        build = {"tensorflow": _tensorflow, "jax": _jax}[backend]
        run = build(x, y.astype("int32"), slices, check, params)
    for _ in range(3):  # trace / compile and warm up
        run()
    return run


def _tensorflow(x, y, slices, check, params):
    import tensorflow as tf

    ws, update, t = _tf_adam(params)
    xs, ys = tf.constant(x), tf.constant(y)
    size = len(x) // slices

    def loss(xb, yb):
        h = xb
        for i in range(0, len(ws), 2):
            h = tf.matmul(h, ws[i]) + ws[i + 1]
            if i + 2 < len(ws):
                h = tf.nn.relu(h)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, h))

    @tf.function(autograph=False)
    def step():
        grads = None
        for k in range(slices):
            with tf.GradientTape() as tape:
                part = loss(xs[k * size : (k + 1) * size], ys[k * size : (k + 1) * size])
                part = part / slices if slices > 1 else part
            g = tape.gradient(part, ws)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        if check:
            norm = tf.sqrt(tf.add_n([2.0 * tf.nn.l2_loss(g) for g in grads]))

            def apply():
                update(grads)
                return tf.constant(0)

            tf.cond(tf.math.is_finite(norm), apply, lambda: tf.constant(0))
        else:
            update(grads)
        return t.read_value()

    return lambda: step().numpy()


def _tf_adam(params):
    """TensorFlow variables for `params` and Adam's update of them (as
    `keras.optimizers.Adam`): returns `(weights, update, t)`, `update(grads)` assigning in
    place and `t` the step count."""
    import tensorflow as tf

    ws = [tf.Variable(p) for p in params]
    ms = [tf.Variable(tf.zeros_like(p)) for p in ws]
    vs = [tf.Variable(tf.zeros_like(p)) for p in ws]
    t = tf.Variable(0.0)

    def update(grads):
        t.assign_add(1.0)
        lr = LR * tf.sqrt(1 - B2**t) / (1 - B1**t)
        for w, m, v, g in zip(ws, ms, vs, grads):
            m.assign_add((g - m) * (1 - B1))
            v.assign_add((tf.square(g) - v) * (1 - B2))
            w.assign_sub(lr * m / (tf.sqrt(v) + EPS))

    return ws, update, t


def _jax_adam(state, grads):
    """Adam (as `keras.optimizers.Adam`) on a (weights, m, v, t) state of JAX arrays."""
    import jax.numpy as jnp

    ws, ms, vs, t = state
    t = t + 1.0
    lr = LR * jnp.sqrt(1 - B2**t) / (1 - B1**t)
    ms = [m + (g - m) * (1 - B1) for m, g in zip(ms, grads)]
    vs = [v + (g * g - v) * (1 - B2) for v, g in zip(vs, grads)]
    ws = [w - lr * m / (jnp.sqrt(v) + EPS) for w, m, v in zip(ws, ms, vs)]
    return ws, ms, vs, t


def _jax_runner(step, params, x, y) -> Callable[[], object]:
    """`step(state, x, y) -> state` jitted (state donated), run on fixed data; waits for it."""
    import jax
    import jax.numpy as jnp

    step = jax.jit(step, donate_argnums=0)
    ws = [jnp.asarray(p) for p in params]
    holder = {"state": (ws, [jnp.zeros_like(w) for w in ws], [jnp.zeros_like(w) for w in ws],
                        jnp.float32(0))}  # fmt: skip
    xs, ys = jnp.asarray(x), jnp.asarray(y)

    def run():
        holder["state"] = step(holder["state"], xs, ys)
        return jax.block_until_ready(holder["state"])

    return run


def _jax(x, y, slices, check, params):
    import jax
    import jax.numpy as jnp

    size = len(x) // slices

    def loss(ws, xb, yb):
        h = xb
        for i in range(0, len(ws), 2):
            h = h @ ws[i] + ws[i + 1]
            if i + 2 < len(ws):
                h = jax.nn.relu(h)
        logp = jax.nn.log_softmax(h)
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=1))

    grad = jax.grad(loss)

    def step(state, xs, ys):
        grads = None
        for k in range(slices):
            g = grad(state[0], xs[k * size : (k + 1) * size], ys[k * size : (k + 1) * size])
            g = [a / slices for a in g] if slices > 1 else g
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        if check:
            norm = jnp.sqrt(sum(jnp.vdot(g, g) for g in grads))
            return jax.lax.cond(jnp.isfinite(norm), _jax_adam, lambda s, g: s, state, grads)
        return _jax_adam(state, grads)

    return _jax_runner(step, params, x, y)


def _torch(x, y, slices, check, params, device=None, compiled=False):
    import torch

    # Kernels stored (inputs, outputs) and applied as h @ w + b, as Keras' Dense does (and as
    # the TF and JAX floors do); torch.nn.Linear would store the transpose and call addmm.
    ws = [torch.tensor(p, requires_grad=True, device=device) for p in params]
    opt = torch.optim.Adam(ws, lr=LR, betas=(B1, B2), eps=EPS)
    xs, ys = torch.from_numpy(x).to(device), torch.from_numpy(y).long().to(device)
    cuda = xs.device.type == "cuda"
    size = len(x) // slices
    loss_fn = torch.nn.CrossEntropyLoss()

    def forward(xb):
        h = xb
        for i in range(0, len(ws), 2):
            h = h @ ws[i] + ws[i + 1]
            if i + 2 < len(ws):
                h = torch.relu(h)
        return h

    if compiled:
        forward = torch.compile(forward)

    def run():
        opt.zero_grad()
        for k in range(slices):
            part = loss_fn(forward(xs[k * size : (k + 1) * size]), ys[k * size : (k + 1) * size])
            (part / slices if slices > 1 else part).backward()
        if check:
            grads = [w.grad.reshape(-1) for w in ws]
            norm = torch.stack([torch.vdot(g, g) for g in grads]).sum().sqrt()
            if bool(torch.isfinite(norm)):
                opt.step()
        else:
            opt.step()
        if cuda:
            torch.cuda.synchronize()

    return run


def raw_cnn_step(
    x: np.ndarray, y: np.ndarray, slices: int = 1, loop: str = "scan"
) -> Callable[[], object]:
    """One training step (Adam) of the small CNN in bare JAX (see module docstring)."""
    import jax
    import jax.numpy as jnp
    import keras

    if keras.backend.backend() != "jax":
        raise ValueError("raw_cnn_step is written for the JAX backend.")
    if len(x) % slices:
        raise ValueError(f"`slices` ({slices}) must divide the batch ({len(x)}).")
    if loop not in ("scan", "unrolled"):
        raise ValueError(f"`loop` must be 'scan' or 'unrolled', got {loop!r}.")
    rng = np.random.default_rng(0)
    shapes = [(3, 3, 1, 16), (16,), (3, 3, 16, 32), (32,), (800, 10), (10,)]
    params = [
        rng.normal(0, (2.0 / np.prod(s[:-1])) ** 0.5, s).astype("float32")
        if len(s) > 1
        else np.zeros(s, "float32")
        for s in shapes
    ]
    dn = ("NHWC", "HWIO", "NHWC")

    def pool(h):
        return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    def loss(ws, xb, yb):
        h = xb
        for i in (0, 2):
            h = jax.lax.conv_general_dilated(h, ws[i], (1, 1), "VALID", dimension_numbers=dn)
            h = pool(jax.nn.relu(h + ws[i + 1]))
        h = h.reshape(h.shape[0], -1) @ ws[4] + ws[5]
        logp = jax.nn.log_softmax(h)
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=1))

    grad = jax.grad(loss)
    size = len(x) // slices

    def step(state, xs, ys):
        ws = state[0]
        if slices == 1:
            return _jax_adam(state, grad(ws, xs, ys))
        if loop == "scan":
            parts = (xs.reshape((slices, size) + xs.shape[1:]), ys.reshape(slices, size))

            def body(acc, part):
                return [a + g / slices for a, g in zip(acc, grad(ws, *part))], None

            grads, _ = jax.lax.scan(body, [jnp.zeros_like(w) for w in ws], parts)
        else:
            grads = [jnp.zeros_like(w) for w in ws]
            for k in range(slices):
                g = grad(ws, xs[k * size : (k + 1) * size], ys[k * size : (k + 1) * size])
                grads = [a + b / slices for a, b in zip(grads, g)]
        return _jax_adam(state, grads)

    run = _jax_runner(step, params, x, y.astype("int32"))
    for _ in range(2):  # compile and warm up
        run()
    return run


def keras_loop_step(model, x: np.ndarray, y: np.ndarray, slices: int = 1) -> Callable[[], object]:
    """Gradient accumulation written by hand around a compiled Keras model, on PyTorch.

    Per slice: `model(x, training=True)`, `model.compute_loss`, `backward()`; then one
    `model.optimizer.apply`. Nothing else of keras-perf's step (no norm, no skip, no metrics):
    what any accumulation through Keras' eager layers costs. `model` must be built.
    """
    import keras
    import torch

    if keras.backend.backend() != "torch":
        raise ValueError("keras_loop_step is written for the PyTorch backend.")
    if len(x) % slices:
        raise ValueError(f"`slices` ({slices}) must divide the batch ({len(x)}).")
    xs, ys = torch.as_tensor(x), torch.as_tensor(y)
    size = len(x) // slices
    variables = model.trainable_variables

    def run():
        model.zero_grad()
        for k in range(slices):
            xb, yb = xs[k * size : (k + 1) * size], ys[k * size : (k + 1) * size]
            loss = model.compute_loss(x=xb, y=yb, y_pred=model(xb, training=True), training=True)
            (loss / slices if slices > 1 else loss).backward()
        with torch.no_grad():
            model.optimizer.apply([v.value.grad for v in variables], variables)

    for _ in range(3):  # warm up
        run()
    return run

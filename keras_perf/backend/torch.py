"""PyTorch implementation of the backend interface (see `keras_perf.backend`)."""

from __future__ import annotations

import weakref

import torch

from keras_perf.backend._step_spy import StepSpy


def is_oom_error(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(
        torch.cuda, "OutOfMemoryError", None
    )
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    # Older releases and non-CUDA allocators raise a plain RuntimeError.
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def oom_error(message: str) -> BaseException:
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(
        torch.cuda, "OutOfMemoryError", None
    )
    return (
        oom_type(f"CUDA out of memory. {message}")
        if oom_type
        else RuntimeError(f"out of memory: {message}")
    )


def memory_stats():
    if not torch.cuda.is_available():
        return None
    return {
        "current_bytes": int(torch.cuda.memory_allocated()),
        "peak_bytes": int(torch.cuda.max_memory_allocated()),
        "device": f"cuda:{torch.cuda.current_device()}",
        "measure": "torch_cuda_peak",
    }


def reset_peak_memory() -> bool:
    if not torch.cuda.is_available():
        return False
    torch.cuda.reset_peak_memory_stats()
    return True


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedTensorsPeak:
    """Peak bytes of the distinct storages autograd keeps for backward, weights and data not.

    Its `pack`/`unpack` go to `torch.autograd.graph.saved_tensors_hooks`; a storage held by
    several saved tensors counts once, and counts until the last of them is released. The
    storages in `excluded` (the weights) and tensors outside the graph (input data) are not
    counted: they live beside the step anyway.
    """

    def __init__(self, excluded=()):
        self.excluded, self.live, self.current, self.peak = set(excluded), {}, 0, 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.excluded or (t.grad_fn is None and not t.requires_grad):
            return t
        holder = _Holder(t)
        if ptr not in self.live:
            self.current += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.current)
        self.live[ptr] = self.live.get(ptr, 0) + 1
        weakref.finalize(holder, self._release, ptr, t.untyped_storage().nbytes())
        return holder

    def _release(self, ptr, nbytes):
        self.live[ptr] -= 1
        if not self.live[ptr]:
            del self.live[ptr]
            self.current -= nbytes

    @staticmethod
    def unpack(h):
        return h.tensor if isinstance(h, _Holder) else h


def step_memory_unavailable():
    return None


def step_memory(model, data, run_step, sizes) -> dict:
    """On CUDA, the allocator's peak during `run_step()` above its bytes in use before, plus
    the model's and optimizer's variables (held before). On a CPU, where torch keeps no
    allocator statistics, the peak of the tensors saved for backward plus the variables, one
    gradient per trainable weight and the batch."""
    model.zero_grad(set_to_none=True)  # gradients left by an earlier step would count as "before"
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run_step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        return {"bytes": int(sizes["state"] + peak), "measure": "torch_cuda_peak", "ran": True}
    saved = SavedTensorsPeak(v.value.untyped_storage().data_ptr() for v in model.variables)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        run_step()
    total = sizes["state"] + sizes["trainable"] + sizes["batch"] + saved.peak
    return {"bytes": int(total), "measure": "torch_saved_tensors", "ran": True}


class _SavedTensorsEpochMemory(StepSpy):
    """`step_memory`'s CPU count (tensors saved for backward plus variables, gradients and
    batch) of each epoch's first training step, taken while `fit` runs it."""

    def __init__(self, model, sizes) -> None:
        super().__init__(model)
        self._sizes = sizes
        self._armed = False
        self._bytes = None

    def call(self, original, data):
        if not self._armed:
            return original(data)
        self._armed = False
        saved = SavedTensorsPeak(v.value.untyped_storage().data_ptr() for v in self.model.variables)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            logs = original(data)
        sizes = self._sizes(self.model, data[0])
        self._bytes = sizes["state"] + sizes["trainable"] + sizes["batch"] + saved.peak
        return logs

    def start_epoch(self) -> None:
        self._bytes = None
        self._armed = self.install()

    def finish_epoch(self):
        if self._bytes is None:
            return None
        return {"bytes": int(self._bytes), "measure": "torch_saved_tensors", "device": "cpu"}

    def close(self) -> None:
        self._armed = False
        self.remove()


def epoch_memory(model, sizes):
    """The saved-tensor count of each epoch's first step, where `fit` runs the step eagerly
    (not under `torch.compile`, whose graphs the hooks do not see)."""
    if torch.cuda.is_available() or getattr(model, "train_function", None) is None:
        return None
    if getattr(model, "jit_compile", False):
        return None
    return _SavedTensorsEpochMemory(model, sizes)


def list_devices():
    devices = [{"name": "cpu", "kind": "CPU", "memory_bytes": None, "compute_capability": None}]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "name": props.name,
                    "kind": "GPU",
                    "memory_bytes": int(props.total_memory),
                    "compute_capability": (props.major, props.minor),
                }
            )
    return devices


def configure_devices(memory_growth: bool, memory_limit_mb):
    if not torch.cuda.is_available():
        return ["no CUDA device visible to PyTorch: nothing to configure"]
    # PyTorch's caching allocator already grows on demand: memory_growth=True is its default.
    notes = ["memory growth: PyTorch's caching allocator always allocates on demand"]
    if not memory_growth:
        notes.append("memory_growth=False has no PyTorch equivalent (it never preallocates)")
    if memory_limit_mb is not None:
        for i in range(torch.cuda.device_count()):
            total = torch.cuda.get_device_properties(i).total_memory
            fraction = min(1.0, memory_limit_mb * 2**20 / total)
            torch.cuda.set_per_process_memory_fraction(fraction, i)
            notes.append(f"cuda:{i}: memory limited to {memory_limit_mb} MB ({fraction:.1%})")
    return notes


def clear_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fake_quant(x, min_vals, max_vals, num_bits: int, narrow_range: bool, axis=None):
    """`keras.quantizers.fake_quant_with_min_max_vars` with torch's fused fake-quantize ops.

    Keras' torch path is some twenty elementwise ops under a Python `custom_gradient`; this is
    the same arithmetic (TensorFlow's nudged range, Keras' rounding) in a handful, 2-5x
    cheaper per call. Clamping to the nudged range first gives Keras' straight-through
    gradient exactly: zero outside the range, unchanged inside it. The range gets no gradient
    (the callers' ranges are moving averages or `max |w|`, not trained). 2-8 bits; 16-bit
    ranges are left to Keras (torch's op and Keras' disagree on rounding ties at 65535 levels).
    """
    import torch

    qmin, qmax = (1 if narrow_range else 0), 2**num_bits - 1
    with torch.no_grad():  # the range's arithmetic needs no autograd record
        lo = torch.as_tensor(min_vals, dtype=torch.float32, device=x.device)
        hi = torch.as_tensor(max_vals, dtype=torch.float32, device=x.device)
        scale = (hi - lo) / (qmax - qmin)
        zero = torch.clamp(torch.floor(qmin - lo / scale + 0.5), qmin, qmax)
        low, high = (qmin - zero) * scale, (qmax - zero) * scale
        zero = zero.int()
    xf = x if x.dtype == torch.float32 else x.float()
    if axis is None:
        y = torch.fake_quantize_per_tensor_affine(
            torch.clamp(xf, low, high), scale, zero, qmin, qmax
        )
    else:
        shape = [1] * x.ndim
        shape[axis] = -1
        clamped = torch.clamp(xf, low.reshape(shape), high.reshape(shape))
        y = torch.fake_quantize_per_channel_affine(clamped, scale, zero, axis, qmin, qmax)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def fake_quant_kernel(kernel, bits: int, channel_axes, tiny: float):
    """Symmetric narrow-range fake quantization of a kernel in torch ops (what
    `keras_perf.quantization._quantizers.fake_quant_kernel` computes with Keras ops): integers
    in [-(2^(b-1)-1), 2^(b-1)-1] times `max |w| / (2^(b-1)-1)` per channel. Every weight lies
    inside its range, so the straight-through gradient is the identity."""
    import torch

    w = kernel.value if hasattr(kernel, "value") else kernel
    if w.dtype != torch.float32:  # mixed precision: torch's ops take float32 (Keras casts too)
        return fake_quant_kernel(w.float(), bits, channel_axes, tiny).to(w.dtype)
    q = 2 ** (bits - 1) - 1
    a = w.detach().abs()
    if channel_axes is None:
        scale = torch.clamp(a.amax(), min=tiny) / q
        return torch.fake_quantize_per_tensor_affine(w, scale, _zero_int(scale), -q, q)
    flat = w
    if len(channel_axes) > 1:  # Depthwise: channels = in x multiplier, the last two axes.
        flat = w.reshape(*w.shape[: channel_axes[0]], -1)
        a = flat.detach().abs()
    axis = flat.ndim - 1 if len(channel_axes) > 1 else channel_axes[0]
    dims = [d for d in range(flat.ndim) if d != axis]
    scale = torch.clamp(a.amax(dim=dims) if dims else a, min=tiny) / q
    y = torch.fake_quantize_per_channel_affine(flat, scale, _zero_int(scale), axis, -q, q)
    return y.reshape(w.shape)


def _zero_int(scale):
    import torch

    return torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)


def moving_average_fake_quant(x, min_var, max_var, initialized_var, decay, bits, training):
    """`keras_perf.quantization.ActivationQuantizer.call` in torch ops: in training, the range
    moves towards the batch's min and max (widened to include 0; the first batch with a
    non-zero value sets it) and the variables are updated in place, as Keras' `assign` does;
    the range is at least `eps * (2^bits - 1)` wide (`widen_range`); then `fake_quant`."""
    import torch

    lo, hi = min_var.value, max_var.value
    with torch.no_grad():
        if training:
            batch_min, batch_max = torch.aminmax(x.detach())
            batch_min = torch.clamp(batch_min.float(), max=0.0)
            batch_max = torch.clamp(batch_max.float(), min=0.0)
            first = initialized_var.value == 0
            # lerp(batch, old, decay) = decay * old + (1 - decay) * batch, in one op.
            lo = torch.where(first, batch_min, torch.lerp(batch_min, lo, decay))
            hi = torch.where(first, batch_max, torch.lerp(batch_max, hi, decay))
        lo = torch.clamp(lo, max=0.0)
        hi = torch.maximum(
            torch.clamp(hi, min=0.0), lo + torch.finfo(torch.float32).eps * (2**bits - 1)
        )
        if training:
            min_var.value.copy_(lo)
            max_var.value.copy_(hi)
            initialized_var.value.copy_(torch.logical_or(~first, batch_max > batch_min))
    return fake_quant(x, lo, hi, bits, False)


def global_rng_state():
    """torch's global RNG state, which Keras' `fit` and `clone_model` draw from on torch."""
    return torch.random.get_rng_state()


def set_global_rng_state(state) -> None:
    torch.random.set_rng_state(state)


def kernel_op(op: str, dtype: str, size: int):
    """A callable running one `op` ("matmul": two size x size matrices; "conv": a 3x3
    convolution, batch 16, 64 x size x size) in `dtype` on the device Keras uses (CUDA when
    available), returning once the result exists. Raises where the dtype has no kernel."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, dtype)
    # A generator of its own: torch's global one is what the next `fit` shuffles with (a
    # `TrainingMonitor` measures these kernels at the start of the first fit it watches).
    g = torch.Generator(device=device).manual_seed(0)
    if op == "matmul":
        a = torch.rand(size, size, device=device, generator=g).to(dt)
        b = torch.rand(size, size, device=device, generator=g).to(dt)
        fn = torch.matmul
    else:
        a = torch.rand(16, 64, size, size, device=device, generator=g).to(dt)
        b = torch.rand(64, 64, 3, 3, device=device, generator=g).to(dt)

        def fn(x, k):
            return torch.nn.functional.conv2d(x, k, padding=1)

    def run():
        with torch.no_grad():
            y = fn(a, b)
        return float(y.reshape(-1)[0])  # .item() waits for the result

    return run

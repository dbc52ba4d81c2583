"""Small builders of the architectures users actually write, shared by the tests.

Each entry of `ARCHS` is an `Arch`: a builder of a fresh, uncompiled model (at a size that
trains a step in well under a second on a CPU), the data it takes, and the compile settings a
user would give it. `make_data(arch, n)` returns `(x, y, sample_weight)` with the model's own
input and output structure (dicts for the dict model).

Builders take `bases=(keras.Model,)`, the classes the subclassed model derives from, so a test can
give that architecture keras-perf's train step the documented way
(`class M(kp.LossScaleTrainStep, keras.Model)`); the other architectures are Sequential or
Functional, and get the train step through `kp.loss_scaled`.
"""

import dataclasses
from collections.abc import Callable

import keras
import numpy as np

IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
SEQ_LEN, VOCAB, TEXT_CLASSES = 12, 50, 4


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture: how to build it, feed it and compile it."""

    name: str
    build: Callable[..., keras.Model]
    inputs: str  # "image" | "tokens" | "dict" | "vector"
    classes: int
    batchnorm: bool = False  # BatchNormalization: micro-batch statistics differ
    dropout: bool = False  # Dropout: micro-batches draw other masks
    embedding: bool = False
    recurrent: bool = False
    attention: bool = False
    dict_io: bool = False
    subclassed: bool = False
    softmax: bool = False  # the output is probabilities (keras.applications' default)
    slow: bool = False

    @property
    def deterministic_step(self):
        """Whether one micro-batched step must equal the full-batch step to rounding."""
        return not (self.batchnorm or self.dropout)

    def loss(self):
        """The loss a user compiles this model with (`loss_weights` too, for the dict model)."""
        if self.dict_io:
            return {
                "loss": {
                    "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    "score": keras.losses.MeanSquaredError(),
                },
                "loss_weights": {"label": 1.0, "score": 0.5},
            }
        return {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=not self.softmax)}


# -- small MLPs and a one-layer subclassed model (the unit tests' own models) ----------------
def mlp(
    widths=(16,),
    inputs=64,
    classes=10,
    *,
    activation="relu",
    seed=None,
    name=None,
    hidden_names=None,
    out_name=None,
    out_activation=None,
    functional=False,
    **out_kwargs,
):
    """An uncompiled MLP: `Input((inputs,))`, `Dense(w, activation)` per width, `Dense(classes)`.

    Args:
        widths: Units of the hidden layers. Defaults to `(16,)`.
        inputs: Input features. Defaults to `64` (digits).
        classes: Units of the output layer. Defaults to `10`.
        activation: Activation of the hidden layers. Defaults to `"relu"`.
        seed: If not `None`, `keras.utils.set_random_seed(seed)` before the layers are made.
        name: The model's name (`None`: Keras's default).
        hidden_names: Names of the hidden layers (`None`: Keras's defaults).
        out_name: Name of the output layer (`None`: Keras's default).
        out_activation: Activation of the output layer. Defaults to `None` (logits).
        functional: `True` builds a functional `keras.Model`, `False` a `keras.Sequential`.
        **out_kwargs: Further arguments of the output `Dense` (`dtype`, ...).
    """
    if seed is not None:
        keras.utils.set_random_seed(seed)
    names = hidden_names if hidden_names is not None else [None] * len(widths)
    layers = [keras.layers.Dense(w, activation=activation, name=n) for w, n in zip(widths, names)]
    layers.append(
        keras.layers.Dense(classes, activation=out_activation, name=out_name, **out_kwargs)
    )
    if not functional:
        return keras.Sequential([keras.Input((inputs,)), *layers], name=name)
    inp = h = keras.Input((inputs,))
    for layer in layers:
        h = layer(h)
    return keras.Model(inp, h, name=name)


class OneDense(keras.Model):
    """A subclassed model of one `Dense(units)`, unbuilt until first called."""

    def __init__(self, units=3, name=None):
        super().__init__(name=name)
        self.d = keras.layers.Dense(units)

    def call(self, x):
        return self.d(x)


# -- keras.applications ----------------------------------------------------------------------
def mobilenet_v2(bases=(keras.Model,)):
    return keras.applications.MobileNetV2(
        input_shape=IMAGE_SHAPE, alpha=0.35, weights=None, classes=NUM_CLASSES
    )


def resnet50(bases=(keras.Model,)):
    return keras.applications.ResNet50(input_shape=IMAGE_SHAPE, weights=None, classes=NUM_CLASSES)


def efficientnet_b0(bases=(keras.Model,)):
    return keras.applications.EfficientNetB0(
        input_shape=IMAGE_SHAPE, weights=None, classes=NUM_CLASSES
    )


# -- text ------------------------------------------------------------------------------------
def transformer_encoder(bases=(keras.Model,), dim=16, heads=2):
    """Embedding + one post-norm encoder block (MultiHeadAttention, LayerNorm, Dense) + head."""
    tokens = keras.Input((SEQ_LEN,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, dim, name="embed")(tokens)
    a = keras.layers.MultiHeadAttention(heads, key_dim=dim // heads, name="mha")(h, h)
    h = keras.layers.LayerNormalization(name="ln1")(keras.layers.Add()([h, a]))
    f = keras.layers.Dense(2 * dim, activation="relu", name="ff1")(h)
    f = keras.layers.Dense(dim, name="ff2")(f)
    h = keras.layers.LayerNormalization(name="ln2")(keras.layers.Add()([h, f]))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(TEXT_CLASSES, name="logits")(h), name="encoder")


def bilstm(bases=(keras.Model,), dim=8):
    return keras.Sequential(
        [
            keras.Input((SEQ_LEN,), dtype="int32"),
            keras.layers.Embedding(VOCAB, dim, name="embed"),
            keras.layers.Bidirectional(keras.layers.LSTM(dim), name="bilstm"),
            keras.layers.Dense(TEXT_CLASSES, name="logits"),
        ],
        name="bilstm",
    )


# -- dict in, dict out -----------------------------------------------------------------------
def dict_io(bases=(keras.Model,)):
    """Two named inputs, two named outputs (a class and a score), as multi-task models are."""
    image = keras.Input((8,), name="image")
    meta = keras.Input((3,), name="meta")
    h = keras.layers.Concatenate()(
        [keras.layers.Dense(8, activation="relu", name="image_dense")(image), meta]
    )
    h = keras.layers.Dense(8, activation="relu", name="trunk")(h)
    outputs = {
        "label": keras.layers.Dense(TEXT_CLASSES, name="label")(h),
        "score": keras.layers.Dense(1, name="score")(h),
    }
    return keras.Model({"image": image, "meta": meta}, outputs, name="multitask")


# -- subclassed, never built before compile/fit ----------------------------------------------
def subclassed(bases=(keras.Model,)):
    class SubclassedMLP(*bases):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
            self.out = keras.layers.Dense(TEXT_CLASSES, name="logits")

        def call(self, x, training=False):
            return self.out(self.hidden(x))

    return SubclassedMLP(name="subclassed_mlp")


ARCHS = {
    a.name: a
    for a in [
        Arch("mobilenet_v2", mobilenet_v2, "image", NUM_CLASSES, batchnorm=True, softmax=True),
        Arch("resnet50", resnet50, "image", NUM_CLASSES, batchnorm=True, softmax=True, slow=True),
        Arch(
            "efficientnet_b0",
            efficientnet_b0,
            "image",
            NUM_CLASSES,
            batchnorm=True,
            dropout=True,
            softmax=True,
            slow=True,  # its XLA/graph builds take the longest: out of the default tier
        ),
        Arch(
            "transformer",
            transformer_encoder,
            "tokens",
            TEXT_CLASSES,
            embedding=True,
            attention=True,
        ),
        Arch("bilstm", bilstm, "tokens", TEXT_CLASSES, embedding=True, recurrent=True),
        Arch("dict_io", dict_io, "dict", TEXT_CLASSES, dict_io=True),
        Arch("subclassed", subclassed, "vector", TEXT_CLASSES, subclassed=True),
    ]
}


def make_data(arch, n=8, seed=0):
    """`(x, y, sample_weight)` for `arch`: random inputs in its structure, labels, weights.

    `sample_weight` is `None` except for the dict model, whose users weight examples.
    """
    rng = np.random.default_rng(seed)
    if arch.inputs == "image":
        # As `preprocess_input` leaves them for MobileNetV2 (EfficientNet rescales itself).
        x = rng.uniform(-1, 1, (n, *IMAGE_SHAPE)).astype("float32")
    elif arch.inputs == "tokens":
        x = rng.integers(0, VOCAB, (n, SEQ_LEN)).astype("int32")
    elif arch.inputs == "dict":
        x = {
            "image": rng.normal(size=(n, 8)).astype("float32"),
            "meta": rng.normal(size=(n, 3)).astype("float32"),
        }
    else:
        x = rng.normal(size=(n, 10)).astype("float32")
    labels = rng.integers(0, arch.classes, n).astype("int32")
    if arch.dict_io:
        y = {"label": labels, "score": rng.normal(size=(n, 1)).astype("float32")}
        return x, y, rng.uniform(0.5, 2.0, n).astype("float32")
    return x, labels, None


def compile_model(arch, model, optimizer=None, **kwargs):
    """Compile `model` as a user of `arch` would (SGD by default: updates exact to compare)."""
    optimizer = optimizer if optimizer is not None else keras.optimizers.SGD(0.05)
    model.compile(optimizer=optimizer, **arch.loss(), **kwargs)
    return model


def digits_cnn(seed=0):
    """Conv-BN-ReLU, MaxPool, Dense on 8x8x1 digits images (QAT and ONNX tests)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 1), name="image")
    h = keras.layers.Conv2D(8, 3, padding="same")(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(10)(h))


def mixed_and_float32_twins(policy="mixed_bfloat16"):
    """A two-input Functional model (a nested Sequential, Dropout) built under `policy`, and
    the same graph built in float32 with the same weights."""

    def build():
        a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
        inner = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu")])
        h = keras.layers.Dropout(0.2)(inner(keras.layers.Concatenate()([a, b])))
        return keras.Model([a, b], keras.layers.Dense(3, dtype="float32")(h))

    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    mixed = build()
    keras.mixed_precision.set_global_policy("float32")
    plain = build()
    plain.set_weights(mixed.get_weights())
    return mixed, plain

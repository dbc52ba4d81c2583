"""Study: gradual channel pruning + fine-tuning vs the same small CNN trained from scratch (digits).

sklearn's bundled digits as 8x8x1 images (1437 train / 360 test, the split of the tests), a
small CNN (BatchNorm momentum 0.9): Conv(32)-BN-ReLU, Conv(32)-BN-ReLU, MaxPool, Conv(64)-BN-ReLU, a residual
Conv(64)-BN added to it, GlobalAveragePooling, Dense(64, relu), Dense(10). Adam at 1e-3,
batch 32 (45 steps per epoch), `EPOCHS` epochs in every variant:

- dense: the full CNN, `EPOCHS` epochs;
- pruned: the full CNN for `PRUNE_EPOCHS` epochs with `kp.ChannelPruningCallback` and
  `kp.PolynomialDecay` from 0 to the target fraction of channels (steps 90 to 360, i.e.
  epochs 2 to 8, a mask update every 15 steps), then `kp.shrink` and `EPOCHS - PRUNE_EPOCHS` epochs of fine-tuning
  of the small model (a fresh Adam at 1e-3). Accuracy is read right after `shrink` (the
  masked model's, exactly) and after fine-tuning;
- scratch: the shrunk architecture (`from_config` of the shrunk model, new weights) trained
  from scratch for `EPOCHS` epochs: the honest baseline, same architecture, same epochs.

Test accuracy (%) is the mean ± std over the seeds. Run:

    KERAS_BACKEND=tensorflow python -m benchmarks.study_channel_pruning --json study.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_perf as kp  # noqa: E402

from . import _harness  # noqa: E402

SEEDS = (0, 1, 2)
FRACTIONS = (0.25, 0.5, 0.75, 0.9)
EPOCHS = 20
PRUNE_EPOCHS = 14
BATCH = 32
STEPS = 45  # ceil(1437 / 32)
LR = 1e-3
L = keras.layers


def digits_images():
    (xtr, ytr), (xte, yte) = _harness.digits()
    return (xtr.reshape(-1, 8, 8, 1), ytr), (xte.reshape(-1, 8, 8, 1), yte)


def cnn() -> keras.Model:
    inp = keras.Input((8, 8, 1), name="image")
    x = L.ReLU()(
        L.BatchNormalization(momentum=0.9, name="bn1")(
            L.Conv2D(32, 3, padding="same", name="c1")(inp)
        )
    )
    x = L.ReLU()(
        L.BatchNormalization(momentum=0.9, name="bn2")(
            L.Conv2D(32, 3, padding="same", name="c2")(x)
        )
    )
    x = L.MaxPooling2D()(x)
    x = L.ReLU()(
        L.BatchNormalization(momentum=0.9, name="bn3")(
            L.Conv2D(64, 3, padding="same", name="c3")(x)
        )
    )
    y = L.BatchNormalization(momentum=0.9, name="bn4")(
        L.Conv2D(64, 3, padding="same", name="c4")(x)
    )
    x = L.ReLU()(L.Add()([x, y]))
    x = L.GlobalAveragePooling2D()(x)
    x = L.Dense(64, activation="relu", name="fc")(x)
    return keras.Model(inp, L.Dense(10, name="logits")(x), name="cnn")


def compile_(model):
    model.compile(
        keras.optimizers.Adam(LR), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def accuracy(model, x, y) -> float:
    return float(np.mean(np.argmax(model.predict(x, batch_size=512, verbose=0), -1) == y))


def params_macs(model) -> tuple[int, int]:
    total = kp.channel_report(model)["total"]
    return total["params_before"], total["macs_before"]


def run_seed(seed, fractions, epochs, prune_epochs, train, test, log):
    rows = []
    keras.utils.set_random_seed(seed)
    dense = compile_(cnn())
    dense.fit(*train, batch_size=BATCH, epochs=epochs, verbose=0)
    p, m = params_macs(dense)
    rows.append({"seed": seed, "fraction": 0.0, "variant": "dense", "acc": accuracy(dense, *test),
                 "params": p, "macs": m})  # fmt: skip
    log(f"seed {seed} dense: {rows[-1]['acc']:.4f}")
    for frac in fractions:
        keras.utils.set_random_seed(seed)  # the same initial weights as the dense run
        model = compile_(cnn())
        end = max(round(0.6 * prune_epochs), 2) * STEPS
        schedule = kp.PolynomialDecay(0.0, frac, begin_step=max(end // 4, 1) if epochs > 5 else 0,
                                      end_step=end, frequency=15)  # fmt: skip
        cb = kp.ChannelPruningCallback(schedule)
        model.fit(*train, batch_size=BATCH, epochs=prune_epochs, verbose=0, callbacks=[cb])
        masked = accuracy(model, *test)
        small = kp.shrink(model)
        shrunk = accuracy(small, *test)
        compile_(small).fit(*train, batch_size=BATCH, epochs=epochs - prune_epochs, verbose=0)
        p, m = params_macs(small)
        rows.append({"seed": seed, "fraction": frac, "variant": "pruned + fine-tuned",
                     "acc": accuracy(small, *test), "acc_after_shrink": shrunk,
                     "acc_masked": masked, "sparsity": cb.sparsity, "params": p, "macs": m,
                     "widths": {n: small.get_layer(n).filters if n[0] == "c"
                                else small.get_layer(n).units for n in ("c1", "c2", "c3", "fc")}})  # fmt: skip
        log(f"seed {seed} {frac:.0%} pruned: masked {masked:.4f} shrunk {shrunk:.4f} "
            f"fine-tuned {rows[-1]['acc']:.4f} widths {rows[-1]['widths']}")  # fmt: skip
        keras.utils.set_random_seed(seed + 1000)
        scratch = compile_(keras.Model.from_config(small.get_config()))
        scratch.fit(*train, batch_size=BATCH, epochs=epochs, verbose=0)
        rows.append({"seed": seed, "fraction": frac, "variant": "scratch (same small model)",
                     "acc": accuracy(scratch, *test), "params": p, "macs": m})  # fmt: skip
        log(f"seed {seed} {frac:.0%} scratch: {rows[-1]['acc']:.4f}")
        keras.backend.clear_session()
    return rows


def summarise(rows) -> str:
    lines = [
        "| channels removed | variant | params | MACs | test accuracy % (after shrink, before fine-tune) |",
        "|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["fraction"], r["variant"]) for r in rows))
    for frac, variant in keys:
        sel = [r for r in rows if r["fraction"] == frac and r["variant"] == variant]
        acc = [100 * r["acc"] for r in sel]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        cell = f"{statistics.mean(acc):.1f} ± {sd:.1f}"
        if "acc_after_shrink" in sel[0]:
            mid = [100 * r["acc_after_shrink"] for r in sel]
            cell += f" ({statistics.mean(mid):.1f})"
        lines.append(
            f"| {frac:.0%} | {variant} | {sel[0]['params']:,} | {sel[0]['macs']:,} | {cell} |"
        )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="1 seed, 50 % only, 6 epochs (4 pruning)")
    args = p.parse_args()
    seeds = SEEDS[:1] if args.quick else SEEDS
    fractions = (0.5,) if args.quick else FRACTIONS
    epochs, prune_epochs = (6, 4) if args.quick else (EPOCHS, PRUNE_EPOCHS)
    train, test = digits_images()
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)

    rows = []
    for seed in seeds:
        rows += run_seed(seed, fractions, epochs, prune_epochs, train, test, log)
    table = summarise(rows)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": keras.backend.backend(), "keras": keras.__version__,
                       "epochs": epochs, "prune_epochs": prune_epochs, "rows": rows,
                       "table": table, "seconds": round(time.time() - t0)}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()

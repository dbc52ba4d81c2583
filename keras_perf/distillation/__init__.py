"""Knowledge distillation: `DistillationModel` and `precompute_teacher_logits`.

The distiller customises only the loss (`compute_loss`); the mechanics — loss scaling under
`mixed_float16`, micro-batching, skipping non-finite steps, clipping — are the loss-scaling
train step's (`kp.LossScaleTrainStep`). The soft-target loss is computed in float32 from
log-softmax values, so no probability is ever passed through `log` (no `log(0)`), and the
teacher runs frozen, in inference mode, outside the gradient.

Public names: `DistillationModel`, `precompute_teacher_logits`.

The parts: `_model` (`DistillationModel`: construction, compile, forward pass, the loss),
`_losses` (the soft-target KL and a user's distillation loss, in float32), `_checks` (what is
refused at construction: output structure, shared layers, the teachers), `_output_kind`
(logits or probabilities, read from the output layer's config, against `from_logits`),
`_features` (feature distillation: layer pairs, projections, the feature loss),
`_serialization` (`get_config`/`from_config` and the compile config) and `_precompute`
(`precompute_teacher_logits`, for offline distillation).
"""

from keras_perf.distillation._model import DistillationModel
from keras_perf.distillation._precompute import precompute_teacher_logits

__all__ = ["DistillationModel", "precompute_teacher_logits"]

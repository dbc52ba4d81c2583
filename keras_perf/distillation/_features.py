"""Feature distillation: matching intermediate activations of the student and the teacher.

The `features` pairs (`_check_feature_pairs`), the layers they name (`_layer_output`), the
learned projections and the two multi-output feature models (`_setup_features`) and the
feature loss (`_feature_term`), as a mixin of `DistillationModel`, which holds the state it
reads (`features`, `feature_weight`, `feature_loss_tracker`). Not here: the soft-target
loss (`_losses`), the forward pass that returns the features (`_model`).
"""

from __future__ import annotations

import keras
from keras import ops


def _layer_output(model, name: str, role: str):
    try:
        return model.get_layer(name).output
    except (ValueError, AttributeError) as exc:
        raise ValueError(
            f"Feature distillation needs the {role} layer {name!r} and its symbolic output: "
            f"{role} '{model.name}' must be a Functional or Sequential model with an input shape "
            f"that contains a layer of that name ({exc})."
        ) from None


def _check_feature_pairs(features, teachers):
    if not features:
        return None
    if teachers is None or len(teachers) != 1:
        raise ValueError("`features` needs exactly one teacher model (not None and not a list).")
    pairs = []
    for pair in features:
        if not (
            isinstance(pair, (list, tuple))
            and len(pair) == 2
            and all(isinstance(n, str) for n in pair)
        ):
            raise ValueError(
                f"`features` must be pairs (student_layer_name, teacher_layer_name); got {pair!r}."
            )
        pairs.append((pair[0], pair[1]))
    return pairs


class _FeatureDistillation:
    """`DistillationModel`'s feature-distillation methods (a mixin; no state of its own)."""

    # -- features -------------------------------------------------------------------------
    def _setup_features(self):
        self.projections = []
        models = None
        if self.features:
            s_out = [self.student.outputs[0]]
            t_out = [self._teacher_list[0].outputs[0]]
            for s_name, t_name in self.features:
                s_feat = _layer_output(self.student, s_name, "student")
                t_feat = _layer_output(self._teacher_list[0], t_name, "teacher")
                s_out.append(s_feat)
                t_out.append(t_feat)
                s_width, t_width = s_feat.shape[-1], t_feat.shape[-1]
                if s_width == t_width:
                    self.projections.append(None)
                else:
                    proj = keras.layers.Dense(t_width, use_bias=False, name=f"projection_{s_name}")
                    proj.build(tuple(s_feat.shape))
                    self.projections.append(proj)
            models = (
                keras.Model(self.student.inputs, s_out, name=f"{self.student.name}_features"),
                keras.Model(self._teacher_list[0].inputs, t_out, name="teacher_features"),
            )
        # Not tracked as attributes: they share the student's and teacher's layers, whose
        # weights are saved once, through `student` and `teacher`.
        object.__setattr__(self, "_feature_models", models)

    def _feature_term(self, s_feats, t_feats, batch):
        """feature_weight · sum of MSE(projected student feature, teacher feature)."""
        f_loss = ops.zeros((), "float32")
        for s_f, t_f, proj in zip(s_feats, t_feats, self.projections):
            if proj is not None:
                s_f = proj(s_f)
            diff = ops.cast(s_f, "float32") - ops.cast(t_f, "float32")
            f_loss = f_loss + ops.mean(ops.square(diff))
        self.feature_loss_tracker.update_state(f_loss, sample_weight=batch)
        return f_loss * self.feature_weight

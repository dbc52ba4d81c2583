"""Saving a `DistillationModel`: its config, its compile config, and its models in them.

The student and the teachers are serialised without their own compile config
(`_serialize_model`) and rebuilt on load (`_deserialize_model`); `_DistillationConfig` holds
`DistillationModel`'s `get_config`, `from_config` and `get_compile_config` (a mixin: the
attributes it reads are the model's). Not here: the train step's own config
(`keras_perf.train_step._base`), the registration (`_model`, on the class).
"""

from __future__ import annotations

import keras


def _serialize_model(model):
    # Without the compile config: a compiled teacher (or student) is loaded as a plain model,
    # and the distiller's file does not carry that model's optimizer.
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    return config


def _deserialize_model(obj):
    if obj is None or isinstance(obj, keras.Model):
        return obj
    return keras.saving.deserialize_keras_object(obj)


class _DistillationConfig:
    """`DistillationModel`'s (compile) config methods (a mixin; no state of its own)."""

    def get_compile_config(self):
        config = super().get_compile_config()
        if config is not None:
            config = dict(config)
            config["distillation_loss"] = keras.saving.serialize_keras_object(
                self._distillation_loss_config
            )
            config["evaluate_distillation"] = self.evaluate_distillation
        return config

    # -- serialisation ----------------------------------------------------------------------
    def get_config(self):
        config = super().get_config()
        teacher = self.teacher
        if isinstance(teacher, list):
            teacher = [_serialize_model(t) for t in teacher]
        elif teacher is not None:
            teacher = _serialize_model(teacher)
        config.update(
            {
                "student": _serialize_model(self.student),
                "teacher": teacher,
                "temperature": self.temperature,
                "alpha": self.alpha,
                "from_logits": self.from_logits,
                "features": [list(p) for p in self.features] if self.features else None,
                "feature_weight": self.feature_weight,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["student"] = _deserialize_model(config["student"])
        teacher = config.get("teacher")
        if isinstance(teacher, list):
            config["teacher"] = [_deserialize_model(t) for t in teacher]
        else:
            config["teacher"] = _deserialize_model(teacher)
        return cls(**config)

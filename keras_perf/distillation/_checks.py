"""What `DistillationModel` refuses about its models: structure, sharing, the teachers.

One output tensor per model (`_check_single_output` at construction, `_check_one_tensor` on
the first batch for models whose output is not known before), no layer or variable shared
between student and teacher (`_check_not_shared`), and the teacher list itself
(`_check_teachers`: models, not the student, built on the student's inputs, with the
student's output shape). Not here: whether outputs are logits or probabilities
(`_output_kind`), the feature pairs (`_features`), the argument checks of numbers and bools
(`keras_perf._utils`).
"""

from __future__ import annotations

import keras


def _output_shape(model):
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return None
    if not outputs or len(outputs) != 1:
        return None
    return tuple(outputs[0].shape)


def _nested_layers(model) -> list:
    """`model` and every layer inside it, depth first (through nested models' `layers`)."""
    out, stack, seen = [], [model], set()
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        out.append(layer)
        stack.extend(reversed(list(getattr(layer, "layers", None) or ())))
    return out


def _check_not_shared(student, teacher) -> None:
    """Raise if the student and a teacher share a layer or a variable.

    The teacher is frozen (`trainable = False`); a layer it shares with the student would be
    frozen in the student too, and its weights would silently stop training.
    """
    teacher_layers = {id(layer): layer for layer in _nested_layers(teacher)}
    for layer in _nested_layers(student):
        if id(layer) in teacher_layers:
            what = (
                "is the teacher" if layer is teacher else f"is a layer of teacher '{teacher.name}'"
            )
            raise ValueError(
                f"The student '{student.name}' contains layer '{layer.name}', which {what}. "
                "The teacher is frozen, so the student's copy would be frozen too and never "
                "train. Give the student its own layers (e.g. `keras.models.clone_model(...)` "
                "for a part taken from the teacher, with `set_weights` to start from the "
                "teacher's values)."
            )
    teacher_vars = {id(v): v for v in teacher.weights}
    for v in student.weights:
        if id(v) in teacher_vars:
            raise ValueError(
                f"The student '{student.name}' and teacher '{teacher.name}' share the variable "
                f"'{v.path}'. The teacher is frozen, so this weight would never train in the "
                "student. Give the student its own variables."
            )


def _output_structure_problem(output) -> str | None:
    """Why `output` (a model's output structure) is not one tensor, or None."""
    if isinstance(output, dict):
        return f"a dict of outputs (keys {sorted(map(str, output))})"
    if isinstance(output, (list, tuple)) and len(output) != 1:
        return f"{len(output)} outputs"
    return None


def _multi_output_error(model_name: str, role: str, problem: str) -> ValueError:
    return ValueError(
        f"The {role} '{model_name}' has {problem}; DistillationModel distils one output "
        "(class axis last). Distil each head with its own DistillationModel over a model that "
        "outputs that head alone (e.g. `keras.Model(m.inputs, m.outputs[i])`)."
    )


def _check_one_tensor(output, model_name: str, role: str) -> None:
    """At the first batch: refuse what `_check_single_output` could not see before."""
    problem = _output_structure_problem(output)
    if problem is None and isinstance(output, (list, tuple)):
        problem = "a list of one output"
    if problem is not None:
        raise _multi_output_error(model_name, role, problem)


def _check_single_output(model, role: str) -> None:
    """Refuse a Functional model with several outputs or a dict output (known at build)."""
    try:
        output = model.output
    except (AttributeError, ValueError, RuntimeError):
        return  # not built / subclassed: checked on the first batch (compute_loss)
    problem = _output_structure_problem(output)
    if problem is not None:
        raise _multi_output_error(model.name, role, problem)


def _check_teachers(student, teacher):
    if teacher is None:
        return None
    teachers = list(teacher) if isinstance(teacher, (list, tuple)) else [teacher]
    if not teachers:
        raise ValueError("`teacher` is an empty list: give at least one teacher model, or None.")
    s_shape = _output_shape(student)
    for t in teachers:
        if not isinstance(t, keras.Model):
            raise TypeError(
                f"`teacher` must be a keras.Model or a list of them, got {type(t).__name__}."
            )
        if t is student:
            raise ValueError(
                "The teacher is the student itself: distil from a separately trained teacher "
                "(e.g. `keras.models.clone_model(model)` trained first), not the model being trained."
            )
        _check_not_shared(student, t)
        symbolic = _build_on_student_inputs(t, student)
        _check_single_output(t, "teacher")
        if symbolic is not None:
            _check_one_tensor(symbolic, t.name, "teacher")
        t_shape = _output_shape(t)
        if t_shape is None and symbolic is not None:
            t_shape = tuple(symbolic.shape)
        if (
            s_shape is not None
            and t_shape is not None
            and (len(s_shape) != len(t_shape) or s_shape[1:] != t_shape[1:])
        ):
            raise ValueError(
                f"Teacher '{t.name}' outputs shape {t_shape} but student '{student.name}' outputs "
                f"{s_shape}: both must give the same classes on the last axis."
            )
    return teachers


def _build_on_student_inputs(teacher, student):
    """Build an unbuilt teacher by calling it on symbolic copies of the student's inputs.

    Its weights must exist before training: on JAX a teacher whose weights would be created
    inside the first (traced, stateless) train step fails there. Returns the symbolic output,
    or None when the teacher was built already or the student's inputs are not known yet
    (then Keras' symbolic build before the first step builds both).
    """
    if teacher.built:
        return None
    inputs = None
    for attr in ("input", "inputs"):  # Functional: its input structure; Sequential: a list
        try:
            inputs = getattr(student, attr)
            break
        except (AttributeError, ValueError, RuntimeError):
            continue
    if isinstance(inputs, list) and len(inputs) == 1:
        inputs = inputs[0]
    if inputs is None or (isinstance(inputs, (list, tuple, dict)) and not inputs):
        return None
    fresh = keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=tuple(t.shape), dtype=t.dtype), inputs
    )
    try:
        return teacher(fresh, training=False)
    except Exception as exc:  # the model's own error, re-raised with what was tried
        shapes = keras.tree.map_structure(lambda t: tuple(t.shape), inputs)
        raise ValueError(
            f"Teacher '{teacher.name}' is not built, and calling it on the student's inputs "
            f"(shape {shapes}) failed: {type(exc).__name__}: {exc}. Build the teacher for "
            "the student's inputs first (e.g. `teacher.build(input_shape)`, or train it)."
        ) from exc

"""Layer selection by `include`/`exclude`: the rules pruning, quantization and channel pruning share.

A selector item is a layer name, a regular expression (a `str` that fully matches, or an
`re.Pattern` that searches) or, where the caller allows it, a `keras.layers.Layer` subclass
(every layer of that class or a subclass of it). A `str` that is not a valid regular expression
is compared as a plain name only.

Used by `keras_perf.pruning` (weights of the selected layers, or weight paths),
`keras_perf.quantization` (the layers `quantize_aware` quantizes) and
`keras_perf.channel_pruning` (producer layers, by name only). What each selects, and its
error messages for an item that matches nothing, stay with each of them.
"""

from __future__ import annotations

import re

import keras


def check_selectors(name: str, value, classes: bool = True, what: str = "layer names") -> tuple:
    """Normalise `include`/`exclude`: None, or one item or a list of them, to a tuple.

    Args:
        name: The argument's name, for the error message.
        value: The argument.
        classes: Whether `keras.layers.Layer` subclasses are accepted. Defaults to `True`.
        what: What the names name, for the error message. Defaults to `"layer names"`.

    Returns:
        A tuple of the items (empty for None).

    Raises:
        TypeError: an item of another kind.
    """
    if value is None:
        return ()
    items = tuple(value) if isinstance(value, (list, tuple, set)) else (value,)
    for item in items:
        if isinstance(item, (str, re.Pattern)):
            continue
        if classes and isinstance(item, type) and issubclass(item, keras.layers.Layer):
            continue
        if classes:
            kinds = (
                f"{what}, regular expressions (str or re.Pattern) or keras.layers.Layer subclasses"
            )
        else:
            kinds = f"{what} (str) or regular expressions"
        raise TypeError(f"`{name}` items must be {kinds}; got {item!r}.")
    return items


def matches_name(item, text: str) -> bool:
    """Whether a name or regex item selects `text` (a layer name or a weight path)."""
    if isinstance(item, re.Pattern):
        return bool(item.search(text))
    if item == text:
        return True
    try:
        return re.fullmatch(item, text) is not None
    except re.error:  # not a valid regex: compared as a plain name only
        return False


def matches_layer(item, layer) -> bool:
    """Whether `item` selects `layer`: its class (for a class item) or its name."""
    if isinstance(item, type):
        return isinstance(layer, item)
    return matches_name(item, layer.name)


def matches_path(item, path: str) -> bool:
    """Whether a name or regex item selects a weight path (a class item never does)."""
    if isinstance(item, type):
        return False
    return matches_name(item, path)


def serialize_selectors(items) -> list | None:
    """`include`/`exclude` items as JSON-able config values (regexes and classes as dicts)."""
    if not items:
        return None
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, re.Pattern):
            out.append({"regex": item.pattern})
        else:
            name = keras.saving.get_registered_name(item)
            out.append({"class_name": item.__name__, "registered_name": name})
    return out


def deserialize_selectors(items):
    """The inverse of `serialize_selectors`."""
    if items is None:
        return None
    out = []
    for item in items:
        if isinstance(item, dict) and "regex" in item:
            out.append(re.compile(item["regex"]))
        elif isinstance(item, dict):
            cls = keras.saving.get_registered_object(item.get("registered_name"))
            cls = cls or getattr(keras.layers, item["class_name"], None)
            if cls is None:
                raise ValueError(
                    f"Unknown layer class {item['class_name']!r} in `include`/`exclude`."
                )
            out.append(cls)
        else:
            out.append(item)
    return out

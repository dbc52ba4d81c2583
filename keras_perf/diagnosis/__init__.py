"""Diagnosis of training speed: where the time of a step goes, and what each change buys.

`diagnose` (in `_core.py`) measures the baseline with real `fit` calls on a twin of the model,
phase by phase, on the inputs `fit` takes (read by `keras_perf._inputs`);
`keras_perf/_fit_measure.py` (shared with `accelerate`) makes the twin and times fits,
`_what_if.py` holds the changes (one function each, walked by `candidates`), `_trial.py` times
each change that applies, `_report.py` holds the `Diagnosis` (table, JSON, plot). Method:
docs/diagnose.md.
"""

from keras_perf.diagnosis._core import diagnose
from keras_perf.diagnosis._report import Diagnosis

__all__ = ["Diagnosis", "diagnose"]

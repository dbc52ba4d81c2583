import pytest

import keras_perf as kp


def test_device_report_lists_cpu():
    report = kp.device_report()
    cpu = [d for d in report if d["kind"] == "CPU"]
    assert len(cpu) >= 1
    assert all(isinstance(d["name"], str) and d["name"] for d in report)


def test_configure_devices_returns_notes():
    notes = kp.configure_devices(memory_growth=True)
    assert isinstance(notes, list) and all(isinstance(n, str) for n in notes)


@pytest.mark.parametrize("limit", [-1, 0])
def test_memory_limit_must_be_positive(limit):
    with pytest.raises(ValueError, match="memory_limit_mb"):
        kp.configure_devices(memory_limit_mb=limit)


@pytest.mark.parametrize(
    "kwargs, arg",
    [({"memory_limit_mb": 1.5}, "memory_limit_mb"), ({"memory_growth": "yes"}, "memory_growth")],
)
def test_configure_devices_type_errors(kwargs, arg):
    with pytest.raises(TypeError, match=arg):
        kp.configure_devices(**kwargs)

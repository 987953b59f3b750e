"""probe.pipeline.allocator: glibc's heap thresholds for the duration of a run, restored after it."""

from __future__ import annotations

import ctypes

import pytest

import probe.pipeline.allocator as allocator


class _Recorder:
    def __init__(self):
        self.calls = []

    def mallopt(self, parameter, value):
        self.calls.append(("mallopt", parameter, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))
        return 1


def test_the_thresholds_are_set_for_the_block_and_restored_after_it(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(allocator, "_glibc", lambda: (recorder.mallopt, recorder.malloc_trim))
    with pytest.raises(RuntimeError, match="a batch failed"):  # restored also when the run fails
        with allocator.kept_heap() as applied:
            assert applied
            assert recorder.calls == [
                ("mallopt", -3, allocator.RUN_MMAP_THRESHOLD), ("mallopt", -1, allocator.RUN_TRIM_THRESHOLD),
            ]
            raise RuntimeError("a batch failed")
    assert recorder.calls[2:] == [("mallopt", -3, 128 << 10), ("mallopt", -1, 128 << 10), ("malloc_trim", 0)]


@pytest.mark.parametrize("variable", allocator._USER_SETTINGS)
def test_the_users_own_malloc_settings_stand(monkeypatch, variable):
    monkeypatch.setenv(variable, "65536")
    assert allocator._glibc() is None
    with allocator.kept_heap() as applied:
        assert not applied


def test_on_glibc_the_real_settings_take_effect():
    try:
        ctypes.CDLL("libc.so.6").gnu_get_libc_version
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    with allocator.kept_heap() as applied:
        assert applied  # glibc accepted both values (it refuses an mmap threshold above its maximum)

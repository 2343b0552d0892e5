"""Triton's install key computed ahead (ember/kernels/triton_key.py): once a process, on its own
thread, and what the first compile then finds cached."""

from __future__ import annotations


def test_the_key_is_computed_once_on_a_thread_and_found_cached() -> None:
    from triton.runtime.cache import triton_key as key

    from ember.kernels import triton_key

    triton_key.start()
    thread = triton_key._thread
    assert thread is not None and thread.name == "triton-key"
    triton_key.start()
    assert triton_key._thread is thread  # once a process
    triton_key.wait()
    assert not thread.is_alive()
    hits = key.cache_info().hits
    assert isinstance(key(), str) and key.cache_info().hits == hits + 1  # no second computation

"""Triton's set-up done ahead (ember/kernels/triton_setup.py): once a process, on its own thread,
and the install key the first compile then finds cached. (Its CUDA utilities need a GPU
machine's libcuda; here their build fails quietly, as it may.)"""

from __future__ import annotations


def test_the_key_is_computed_once_on_a_thread_and_found_cached(monkeypatch, tmp_path) -> None:
    from triton.runtime.cache import triton_key as key

    from ember.kernels import triton_setup

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # (start points it at ember's if unset)
    triton_setup.start()
    thread = triton_setup._thread
    assert thread is not None and thread.name == "triton-setup"
    triton_setup.start()
    assert triton_setup._thread is thread  # once a process
    triton_setup.wait()
    assert not thread.is_alive()
    hits = key.cache_info().hits
    assert isinstance(key(), str) and key.cache_info().hits == hits + 1  # no second computation

"""Shared pytest fixtures.

tiny_checkpoint(family, *, original_format=True, max_shard_size=None) -> directory:
    `tests/hf_configs.tiny_model(family)` saved with `save_pretrained` as safetensors,
    once per session and argument set. original_format=True is transformers' default
    (`save_original_format=True`: the per-expert names released checkpoints use, where
    the family has a conversion mapping), False the fused transformers-5 layout.
hf_quiet: transformers' warnings and progress bars off for the session.
one_thread: torch runs single-threaded for the test (restored after): tiny models are
    several times faster that way on a busy 2-core machine, and results do not change.
one_real_size_layer_at_a_time: an inter-process lock, so xdist workers take turns at tests
    that hold real-size layers on the GPU.
(autouse) after every `gpu`-marked test, the worker hands its cached CUDA memory back.

Nothing here imports transformers until a fixture that needs it runs.
"""

from __future__ import annotations

import gc
import inspect
import os
import tempfile

import pytest
import torch


@pytest.fixture(scope="session")
def hf_quiet():
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    yield
    hf_logging.set_verbosity(verbosity)
    if bars:
        hf_logging.enable_progress_bar()


def save_supports_original_format() -> bool:
    from transformers import PreTrainedModel

    return "save_original_format" in inspect.signature(PreTrainedModel.save_pretrained).parameters


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, hf_quiet):
    from hf_configs import tiny_model

    cache: dict[tuple, str] = {}

    def make(family: str, *, original_format: bool = True, max_shard_size: str | None = None) -> str:
        key = (family, original_format, max_shard_size)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"{family}-{'orig' if original_format else 'fused'}")
            kwargs = {}
            if save_supports_original_format():
                kwargs["save_original_format"] = original_format
            elif not original_format:
                pytest.skip("this transformers' save_pretrained has no save_original_format")
            if max_shard_size is not None:
                kwargs["max_shard_size"] = max_shard_size
            tiny_model(family).save_pretrained(str(directory), **kwargs)
            cache[key] = str(directory)
        return cache[key]

    return make


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def release_cuda_cache() -> None:
    """Hand this process's cached, unused CUDA memory back to the driver (nothing without CUDA).

    Why: tests/gpu_suite.sh runs 8 xdist workers on one card, and PyTorch's caching allocator keeps
    what a finished test freed. On an 80 GB H100 a worker that had run a
    deepseek-v3 real-size layer still held 29 GB while running small tests, and the next real-size
    test on another worker ran out of memory."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _gpu_memory_back(request):
    yield
    if request.node.get_closest_marker("gpu") is not None:
        release_cuda_cache()


@pytest.fixture
def one_real_size_layer_at_a_time():
    """Hold an inter-process lock for the test: pytest-xdist workers take turns at the real-size layers
    (deepseek-v3's experts are 22.5 GB in bf16). The memory goes back before the lock does. A file lock,
    not xdist's loadgroup: that did not group tests with pytest 9.2 and xdist 3.8 here."""
    import fcntl

    with open(os.path.join(tempfile.gettempdir(), "moeflow_real_size_layers.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            release_cuda_cache()
            fcntl.flock(f, fcntl.LOCK_UN)

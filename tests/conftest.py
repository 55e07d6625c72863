"""Shared pytest fixtures.

tiny_checkpoint(family, *, original_format=True, max_shard_size=None) -> directory:
    `tests/hf_configs.tiny_model(family)` saved with `save_pretrained` as safetensors,
    once per session and argument set. original_format=True is transformers' default
    (`save_original_format=True`: the per-expert names released checkpoints use, where
    the family has a conversion mapping), False the fused transformers-5 layout.
hf_quiet: transformers' warnings and progress bars off for the session.
one_thread: torch runs single-threaded for the test (restored after): tiny models are
    several times faster that way on a busy 2-core machine, and results do not change.

Nothing here imports transformers until a fixture that needs it runs.
"""

from __future__ import annotations

import inspect

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

"""Where the trainer keeps JAX's persistent compilation cache: beside the checkpoints, unless the pod's
environment names a directory of its own (the user's JAX_COMPILATION_CACHE_DIR is never overridden), and
nowhere when turned off."""

from __future__ import annotations

import pytest
from conftest import trainer_config

from tpu_workload.performance import compile_cache


@pytest.mark.parametrize(
    "checkpoint, env, expected",
    [
        ("/ckpt/", {}, "/ckpt/compilation-cache"),
        ("gs://bucket/run", {}, "gs://bucket/run/compilation-cache"),
        ("/ckpt", {"JAX_COMPILATION_CACHE_DIR": "/node/cache"}, "/node/cache"),
        (None, {"JAX_COMPILATION_CACHE_DIR": "gs://team/cache"}, "gs://team/cache"),
        (None, {}, None),
        ("/ckpt", {"TPUJOB_COMPILATION_CACHE": "0", "JAX_COMPILATION_CACHE_DIR": "/node/cache"}, None),
        ("/ckpt", {"JAX_COMPILATION_CACHE_DIR": ""}, "/ckpt/compilation-cache"),
    ],
)
def test_the_cache_directory(checkpoint, env, expected):
    assert compile_cache.directory(trainer_config("tiny", checkpoint=checkpoint), env) == expected

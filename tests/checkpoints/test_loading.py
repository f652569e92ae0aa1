import types

import pytest
import torch

from areal_eval.checkpoints import loading
from areal_eval.config.parsing import ConfigError


def test_auto_takes_the_dtype_the_config_records_and_float32_where_it_records_none():
    assert loading.resolve_dtype("auto", types.SimpleNamespace(dtype="bfloat16"), "cpu") is torch.bfloat16
    assert loading.resolve_dtype("auto", types.SimpleNamespace(torch_dtype=torch.float16), "cpu") is torch.float16
    assert loading.resolve_dtype("auto", types.SimpleNamespace(), "cpu") is torch.float32
    assert loading.resolve_dtype("bfloat16", types.SimpleNamespace(dtype="float32"), "cpu") is torch.bfloat16


def test_an_unknown_dtype_or_one_the_device_cannot_run_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"eval.dtype: 'bf16' is not one of auto, float32, bfloat16, float16"):
        loading.resolve_dtype("bf16", types.SimpleNamespace(), "cpu")
    with pytest.raises(ConfigError, match=r"eval.dtype: bfloat16 cannot run on meta"):
        loading.check_dtype_runs(torch.bfloat16, "meta")


def test_a_directory_without_config_is_not_a_checkpoint(tmp_path):
    with pytest.raises(loading.CheckpointError, match="no config.json"):
        loading.architectures(tmp_path)

"""The benches' config-only checkpoints (GPU scripts on --load-format dummy): no weight file, and
a config the engine reads as the architecture it is (a config saved without its model names
none, and the worker would refuse it)."""

from __future__ import annotations

import pytest

from pdserve.worker.models.loader import read_model_config


@pytest.mark.parametrize("which", ["disagg", "fp8_kv"])
def test_config_only_checkpoint_reads_as_llama(tmp_path, which):
    if which == "disagg":
        from pdserve.bench.disagg import make_checkpoint

        make_checkpoint(str(tmp_path), smoke=True, config_only=True)
    else:
        from pdserve.bench.fp8_kv import write_checkpoint

        write_checkpoint(str(tmp_path), smoke=True, device="cpu")
    assert not list(tmp_path.glob("*.safetensors")) and (tmp_path / "tokenizer.json").exists()
    assert read_model_config(str(tmp_path)).architecture == "LlamaForCausalLM"

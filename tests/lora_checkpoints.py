"""Tiny PEFT LoRA adapters for tests, written with peft's own save_pretrained over a test
checkpoint, and the reference they are held to: transformers + PEFT, merged, fp32 greedy."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(out: Path, base: Path, *, seed: int, r: int = 8, alpha: int = 16,
                  target_modules: list[str] = ALL_MODULES, use_rslora: bool = False) -> Path:
    """A LoRA adapter of `base` with random A and B (PEFT's init_lora_weights=False: B is not
    zero, so the adapter changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, use_rslora=use_rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    get_peft_model(model, config).save_pretrained(out)
    return out


@functools.lru_cache(maxsize=None)
def merged_greedy(base: str, adapter: str | None, prompt: tuple[int, ...], max_new: int) -> list[int]:
    """Greedy continuation of `prompt` by transformers, with the adapter merged into the base
    weights by PEFT (merge_and_unload), in fp32."""
    model = _merged(base, adapter)
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return ids[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=4)
def _merged(base: str, adapter: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()

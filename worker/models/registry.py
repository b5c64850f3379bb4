"""Which model class runs which Hugging Face architecture (config/model.py's SUPPORTED_ARCHITECTURES)."""

from __future__ import annotations

from torch import nn


def model_class(architecture: str) -> type[nn.Module]:
    # Imported on demand: a dense model never imports the MoE code (nor, on GPU, its kernel).
    if architecture in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        from pdserve.worker.models.moe_causal_lm import MoeForCausalLM

        return MoeForCausalLM
    if architecture == "GptOssForCausalLM":
        from pdserve.worker.models.gpt_oss import GptOssForCausalLM

        return GptOssForCausalLM
    if architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        from pdserve.worker.models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    from pdserve.worker.models.llama import LlamaForCausalLM

    return LlamaForCausalLM

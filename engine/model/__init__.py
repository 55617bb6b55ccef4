"""The model layer: Qwen3 / Llama / Qwen2 architecture, MTP head, checkpoint loader, tokenizer.

Imports torch and itself only; knows nothing of requests (docs/INTERFACES.md, "Model"; docs/MODEL.md).
"""

from engine.model.config import MTPConfig, ModelConfig, RopeConfig
from engine.model.loader import LoadedModel, load_checkpoint, resolve_device, resolve_dtype, resolve_model_path
from engine.model.mtp import MTPHead
from engine.model.causal_lm import CausalLM
from engine.model.saver import save_checkpoint
from engine.model.tokenizer import IncrementalDecoder, Tokenizer

__all__ = [
    "CausalLM",
    "IncrementalDecoder",
    "LoadedModel",
    "MTPConfig",
    "MTPHead",
    "ModelConfig",
    "RopeConfig",
    "Tokenizer",
    "load_checkpoint",
    "resolve_device",
    "resolve_dtype",
    "resolve_model_path",
    "save_checkpoint",
]

"""Write a trained CausalLM as a standard Hugging Face checkpoint directory the engine's loader reads back.

Tensors go through `engine.model.saver` (the loader's inverse, one name table for both), so export and load
cannot drift apart; this module adds the bf16 cast, the tokenizer files and the generation defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.model.causal_lm import CausalLM
from engine.model.saver import checkpoint_tensors, write_tensors
from engine.train.tokenizer_train import EOT_TOKEN, eot_id

# Plain-text turns: the model has only ever seen Python, so role markers it can read as comments work best.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '# ' + message['role'] + ':\\n' + message['content'] + '\\n\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '# assistant:\\n' }}{%- endif %}"
)


def write_checkpoint(model: CausalLM, tokenizer: Tokenizer, out_dir: Path) -> None:
    """config.json, model.safetensors (bf16), tokenizer.json, tokenizer_config.json, generation_config.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = eot_id(tokenizer)
    config = model.config.to_hf()
    config.update({"bos_token_id": eos, "eos_token_id": eos, "torch_dtype": "bfloat16", "use_cache": True})
    _write_json(out_dir / "config.json", config)
    write_tensors(out_dir, ((name, t.to("cpu", torch.bfloat16)) for name, t in checkpoint_tensors(model)))
    # safetensors creates the file owner-only; a packaged model must be readable by whoever runs the engine
    (out_dir / "model.safetensors").chmod(0o644)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": EOT_TOKEN,
            "pad_token": EOT_TOKEN,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model.config.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, "do_sample": False, "max_new_tokens": 256},
    )


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def directory_mib(path: Path) -> float:
    """Total size of the files in `path`, MiB."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / (1024 * 1024)

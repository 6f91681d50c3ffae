"""Convert a GGUF checkpoint into a Hugging Face directory (float32 safetensors + tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"Converting {gguf_path.name} into {out_dir.parent} (once) ...", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)

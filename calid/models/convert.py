"""Convert a GGUF file once into a safetensors folder that loads in seconds.

transformers dequantizes the GGUF tensors (``from_pretrained(dir,
gguf_file=...)``); we save the fp32 state dict, the config (without its
quantization entry), the tokenizer and the generation config, so that both
calid's decoder and HF transformers load the folder directly.
"""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from calid.errors import ModelSourceError
from calid.progress import progress

DONE_MARKER = "calid-converted.json"


def is_converted(out_dir: Path) -> bool:
    return (out_dir / DONE_MARKER).is_file()


@contextmanager
def building(out_dir: Path, what: str):
    """A temporary folder that replaces ``out_dir`` when the block succeeds and vanishes when it fails,
    so a half-written folder never looks complete."""
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelSourceError(f"could not {what}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert_gguf(gguf_file: Path, out_dir: Path, show_progress: bool = True) -> Path:
    """Dequantize ``gguf_file`` into ``out_dir`` (written atomically); return ``out_dir``."""
    if is_converted(out_dir):
        return out_dir
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = ["dequantize weights", "save safetensors", "convert tokenizer"]
    with building(out_dir, f"convert {gguf_file.name}") as tmp, \
            progress(len(steps), f"convert {gguf_file.name}", "step", show_progress) as bar:
        bar.set_postfix_str(steps[0])
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
        )
        bar.update(1)
        bar.set_postfix_str(steps[1])
        state = _untied_state_dict(model)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        del model, state
        bar.update(1)
        bar.set_postfix_str(steps[2])
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        tokenizer.save_pretrained(tmp)
        bar.update(1)
        (tmp / DONE_MARKER).write_text(json.dumps({"source": str(gguf_file)}) + "\n")
    return out_dir


def _untied_state_dict(model) -> dict:
    """State dict with shared tensors stored once (tied lm_head is dropped)."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        state[name] = tensor.detach().contiguous()
    return state

"""Load a converted model folder into :class:`LlamaModel` plus its tokenizer."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from calid.errors import ModelSourceError
from calid.models.config import ModelConfig
from calid.models.cpu_linear import use_skinny_linears
from calid.models.llama import LlamaModel
from calid.models.source import ModelSource, resolve
from calid.parallel.layout import ShardSpec, tp_range

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: LlamaModel
    tokenizer: object  # transformers tokenizer
    eos_ids: frozenset[int]
    weight_bytes: int  # all parameters, as loaded
    decode_read_bytes: int  # weight bytes one decode step reads (the embedding gives one row unless tied)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg


def weight_footprint(model: LlamaModel) -> tuple[int, int]:
    """(all weight bytes, bytes read per decode step) of an unpacked model."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.embed is None:
        return total, total
    embed = model.embed.weight
    tied = model.lm_head is not None and model.lm_head.weight is embed
    return total, total - (0 if tied else embed.numel() * embed.element_size())


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelSourceError(f"unknown dtype {name!r} (choose from fp32, bf16)") from None


def parse_device(name: str | torch.device) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelSourceError("device 'cuda' requested but no CUDA GPU is available")
    return device


def load_model(spec: str | ModelSource, dtype="fp32", device="cpu", show_progress: bool = True,
               skinny: bool = True, shard: ShardSpec | None = None) -> LoadedModel:
    """Resolve ``spec``, load its weights (only ``shard``'s part, when given) and tokenizer.

    ``skinny`` routes small CPU batches through the faster matmul of cpu_linear; no-op elsewhere.
    """
    source = spec if isinstance(spec, ModelSource) else resolve(spec, show_progress)
    model = load_weights(source.path, dtype, device, skinny, shard)
    footprint = weight_footprint(model)
    tokenizer = load_tokenizer(source.path)
    return LoadedModel(source.spec, source.path, model, tokenizer, eos_token_ids(source.path, tokenizer), *footprint)


def load_weights(path: Path, dtype="fp32", device="cpu", skinny: bool = True,
                 shard: ShardSpec | None = None) -> LlamaModel:
    """The model in folder ``path`` (or one shard of it), without its tokenizer."""
    dtype, device = parse_dtype(dtype), parse_device(device)
    cfg = ModelConfig.from_dir(path)
    model = build_model(cfg, load_state_dict(path, shard), dtype, device, shard)
    if skinny:
        use_skinny_linears(model)
    return model


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(path: Path, tokenizer) -> frozenset[int]:
    """EOS ids from the generation config and the tokenizer (instruct models end turns with their own token)."""
    ids: set[int] = set()
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class Checkpoint(Mapping):
    """The tensors of a safetensors checkpoint, read lazily, each cut to one shard's slice.

    ``shard`` (tensor parallel): q/k/v/gate/up keep the shard's rows, o/down its
    columns, read through safetensors slices, so a shard never holds a whole
    split tensor. A pipeline stage reads only the tensors it asks for.
    ``read_bytes`` counts the bytes handed out.
    """

    ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    COLUMN_SPLIT = ("o_proj", "down_proj")

    def __init__(self, path: Path, shard: ShardSpec | None = None):
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ModelSourceError(f"no .safetensors weights in {path}")
        self.shard = shard
        self._file: dict[str, object] = {}  # tensor name -> the open (memory-mapped) file that holds it
        for file in files:
            f = safe_open(str(file), framework="pt")
            self._file.update((name, f) for name in f.keys())
        self.read_bytes = 0

    def __iter__(self):
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)

    def __contains__(self, name) -> bool:  # without reading the tensor (Mapping's default would)
        return name in self._file

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._file:
            raise KeyError(name)
        tensor = self._read(self._file[name], name)
        self.read_bytes += tensor.numel() * tensor.element_size()
        return tensor

    def _read(self, f, name: str) -> torch.Tensor:
        shard, parts = self.shard, name.split(".")
        module = parts[-2] if len(parts) > 1 else ""
        if shard is None or shard.tp == 1 or module not in self.ROW_SPLIT + self.COLUMN_SPLIT:
            return f.get_tensor(name)
        part = f.get_slice(name)
        shape = part.get_shape()
        if module in self.ROW_SPLIT:  # weight rows, or the bias
            start, end = tp_range(shape[0], shard.tp_rank, shard.tp)
            return part[start:end]
        start, end = tp_range(shape[1], shard.tp_rank, shard.tp)
        return part[:, start:end]


def load_state_dict(path: Path, shard: ShardSpec | None = None) -> Checkpoint:
    return Checkpoint(path, shard)


def build_model(cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor], dtype, device,
                shard: ShardSpec | None = None) -> LlamaModel:
    """Instantiate on the meta device, then adopt the HF tensors (fusing qkv and gate/up).

    With ``shard``, only that shard's part is built and read: its stage's layers
    (numbered from 0), the embedding on the first stage, norm and head on the
    last, and its tensor-parallel slice of every layer (``hf_state`` is then a
    Checkpoint cut to that shard).
    """
    shard = shard or ShardSpec()
    local = shard.local_config(cfg)
    with torch.device("meta"):
        model = LlamaModel(local, embed=shard.first, head=shard.last)
    take = _Taker(hf_state)
    params = {}
    if shard.first:
        params["embed.weight"] = take("model.embed_tokens.weight")
    if shard.last:
        params["norm.weight"] = take("model.norm.weight")
        if "lm_head.weight" in hf_state and not cfg.tie_word_embeddings:
            params["lm_head.weight"] = take("lm_head.weight")
        elif not shard.first:  # tied, and this stage has no embedding to share it with
            params["lm_head.weight"] = take("model.embed_tokens.weight")
    for i, layer in enumerate(shard.layers(cfg)):
        hf, ours = f"model.layers.{layer}.", f"layers.{i}."
        attn = hf + "self_attn."
        params[ours + "attn.wqkv.weight"] = torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"])
        if cfg.qkv_bias:
            params[ours + "attn.wqkv.bias"] = torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"])
        params[ours + "attn.wo.weight"] = take(attn + "o_proj.weight")
        params[ours + "mlp.w_gate_up.weight"] = torch.cat(
            [take(hf + "mlp.gate_proj.weight"), take(hf + "mlp.up_proj.weight")]
        )
        params[ours + "mlp.w_down.weight"] = take(hf + "mlp.down_proj.weight")
        params[ours + "attn_norm.weight"] = take(hf + "input_layernorm.weight")
        params[ours + "mlp_norm.weight"] = take(hf + "post_attention_layernorm.weight")
    if shard.whole:
        take.check_all_used(ignore={"lm_head.weight"})

    for name, tensor in params.items():
        _assign(model, name, tensor.to(device=device, dtype=dtype))
    if shard.last and "lm_head.weight" not in params:
        model.lm_head.weight = model.embed.weight  # tied
    model.eval()
    return model


class _Taker:
    def __init__(self, state: dict[str, torch.Tensor]):
        self.state, self.used = state, set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ModelSourceError(f"checkpoint is missing tensor {name}")
        self.used.add(name)
        return self.state[name]

    def check_all_used(self, ignore: set[str]) -> None:
        left = set(self.state) - self.used - ignore
        if left:
            raise ModelSourceError(f"checkpoint has tensors this decoder does not use: {sorted(left)[:5]}")


def _assign(model: nn.Module, dotted: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = dotted.rpartition(".")
    owner = model.get_submodule(owner_name)
    expected = getattr(owner, attr).shape
    if tuple(expected) != tuple(tensor.shape):
        raise ModelSourceError(f"tensor {dotted} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
    setattr(owner, attr, nn.Parameter(tensor.contiguous(), requires_grad=False))

"""A calid decoder's weights and config under HF transformers' Qwen2/Llama names (unfused q/k/v and gate/up).

The tensors are views of the model's own (no copy), so an HF twin built from
them (``load_state_dict(..., assign=True)``) shares the weights' memory.
"""
from __future__ import annotations

from calid.models.llama import LlamaModel


def hf_state_dict(model: LlamaModel) -> dict:
    cfg, m = model.cfg, model
    state = {"model.embed_tokens.weight": m.embed.weight, "model.norm.weight": m.norm.weight}
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = m.lm_head.weight
    for i, block in enumerate(m.layers):
        hf = f"model.layers.{i}."
        q, k, v = block.attn.wqkv.weight.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        gate, up = block.mlp.w_gate_up.weight.split([cfg.intermediate_size] * 2)
        state.update({
            hf + "self_attn.q_proj.weight": q, hf + "self_attn.k_proj.weight": k, hf + "self_attn.v_proj.weight": v,
            hf + "self_attn.o_proj.weight": block.attn.wo.weight, hf + "mlp.gate_proj.weight": gate,
            hf + "mlp.up_proj.weight": up, hf + "mlp.down_proj.weight": block.mlp.w_down.weight,
            hf + "input_layernorm.weight": block.attn_norm.weight,
            hf + "post_attention_layernorm.weight": block.mlp_norm.weight,
        })
        if cfg.qkv_bias:
            qb, kb, vb = block.attn.wqkv.bias.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            state.update({hf + "self_attn.q_proj.bias": qb, hf + "self_attn.k_proj.bias": kb,
                          hf + "self_attn.v_proj.bias": vb})
    return state


def hf_config(model: LlamaModel) -> dict:
    cfg = model.cfg
    return {
        "model_type": cfg.model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }

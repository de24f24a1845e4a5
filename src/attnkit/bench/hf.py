"""transformers' GPT2Attention holding a reference layer's weights (layer and decode contenders).

Legend: C model width (d_model), H heads.
"""

from __future__ import annotations

from torch import nn

from attnkit.modules import MultiHeadAttention


def gpt2_attention(reference: MultiHeadAttention, implementation: str) -> nn.Module:
    """A transformers GPT2Attention layer holding ``reference``'s weights (Conv1D stores them transposed)."""
    import torch
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    config = GPT2Config(n_embd=reference.d_out, n_head=reference.num_heads, n_positions=1 << 20,
                        attn_pdrop=0.0, resid_pdrop=0.0)
    config._attn_implementation = implementation
    attn = GPT2Attention(config, layer_idx=0).to(reference.out_proj.weight)
    if reference.qkv_proj is None or reference.qkv_proj.bias is None:
        raise ValueError("the reference layer must be a self-attention layer with qkv_bias=True")
    with torch.no_grad():
        attn.c_attn.weight.copy_(reference.qkv_proj.weight.T)  # (3C, C) -> (C, 3C)
        attn.c_attn.bias.copy_(reference.qkv_proj.bias)
        attn.c_proj.weight.copy_(reference.out_proj.weight.T)  # (C, C) transposed
        attn.c_proj.bias.copy_(reference.out_proj.bias)
    return attn.train(reference.training)

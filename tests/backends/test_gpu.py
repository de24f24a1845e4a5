"""GPU-only checks (skipped without CUDA; run where a GPU is lent)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnkit

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_the_default_layer_takes_a_fused_sdpa_kernel(kv_heads):
    """As litgpt's test_sdpa_choice: with the math kernel disabled, a slow fallback would raise."""
    layer = attnkit.MultiHeadAttention(512, 512, 8, num_kv_heads=kv_heads, rope=True).cuda().bfloat16().eval()
    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16)
    expected = layer(x)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    # attnkit's own router could leave SDPA (for chunked or math) and the kernel restriction would never notice:
    # count the calls that reach SDPA, and require them to carry no dense mask (the fused kernels' fast path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            fused = layer(x)
    assert len(calls) == 1 and calls[0] is None
    torch.testing.assert_close(fused, expected)


@pytest.mark.gpu
@cuda
def test_the_compiled_decode_step_replays_a_cuda_graph_with_the_eager_tokens():
    """generate(compile=True) on a GPU captures the step as a CUDA graph ("reduce-overhead"): its outputs are
    overwritten by the next replay, so a loop that kept them would yield later tokens in place of earlier ones,
    and a cache whose address moved would be recorded stale. Greedy float32 tokens equal the eager ones."""
    from attnkit.models.llama import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                   ffn_size=128, context_length=128)).cuda().eval()
    ids = torch.randint(0, 256, (2, 7), device="cuda")  # (B, T)
    eager = model.generate(ids, max_new_tokens=24, stop_ids=[])
    for n in (24, 30):  # the second call: another capacity, the same compiled step recorded anew
        compiled = model.generate(ids, max_new_tokens=n, stop_ids=[], compile=True)
        assert torch.equal(compiled[:, : eager.shape[1]], eager)

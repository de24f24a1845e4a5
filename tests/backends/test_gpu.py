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


class _EvenTokens:
    """A constraint (attnkit.serve.grammar.Constraint) that allows even token ids only; its mask is a CPU tensor,
    as llguidance's is."""

    def __init__(self, vocab_size: int) -> None:
        self.mask = torch.arange(vocab_size) % 2 == 0  # (V,) bool, on the CPU
        self.done = False

    def allowed(self) -> torch.Tensor:
        return self.mask

    def advance(self, token: int) -> None:
        if token % 2:
            raise ValueError(f"token {token} is odd")


def _serve(engine, model) -> list[list[int]]:
    """Each request's tokens from ``engine``: greedy prompts of several lengths (prefill chunks and decode steps
    batched), a seeded sample, penalties, logit_bias with logprobs, and a constraint."""
    from attnkit.models.generation_options import GenerationOptions

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 17, 5, 12, 6, 4)]
    options = [GenerationOptions(max_new_tokens=12) for _ in range(3)] + [
        GenerationOptions(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7),
        GenerationOptions(max_new_tokens=12, frequency_penalty=0.5, repetition_penalty=1.3),
        GenerationOptions(max_new_tokens=12, logit_bias={3: 2.0}, logprobs=2),
        GenerationOptions(max_new_tokens=12)]
    answers: list[list[int]] = [[] for _ in prompts]
    for i, (prompt, o) in enumerate(zip(prompts, options, strict=True)):
        constraint = _EvenTokens(model.vocab_size) if i == len(prompts) - 1 else None
        engine.submit(prompt, o, lambda e, i=i: answers[i].extend(e.token_ids), constraint=constraint)
    while not engine.idle:
        engine.step()
    assert all(t % 2 == 0 for t in answers[-1])
    return answers


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_the_serving_engine_on_a_gpu_gives_the_cpu_engines_tokens(compiled, tmp_path, monkeypatch):
    """attnkit serve --device cuda: the pool, each step's ids, positions and slots, sampling (seeds and steps, a
    constraint's CPU mask) and the compiled decode step all on the model's GPU. A tensor left on the CPU fails
    the step (device mismatch) or the compile (the scratch pool); float32 greedy and seeded tokens equal the CPU
    engine's."""
    import copy
    import getpass
    import os
    import tempfile

    from attnkit.models.llama import LlamaConfig, LlamaModel
    from attnkit.serve import Engine
    from attnkit.serve.compile_cache import CompileCache

    # Inductor's kernels where PyTorch keeps them by default, and the variable restored after the test (a
    # CompileCache sets it where it is unset), as tests/serve/test_graph.py does
    default = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default)
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                   ffn_size=48, context_length=128)).eval()
    model.stop_token_ids = ()
    gpu_model = copy.deepcopy(model).cuda()

    def decode(ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    expected = _serve(Engine(model, decode, kv_memory_mib=1, block_size=4, max_batch=4), model)
    cache = CompileCache.for_model(gpu_model, torch.float32, tmp_path)
    assert cache.key["device"].startswith("cuda ")  # a CPU's compiled step is never loaded for a GPU
    engine = Engine(gpu_model, decode, kv_memory_mib=1, block_size=4, max_batch=4, compile=compiled,
                    compile_cache=cache)
    assert engine.pool.device == next(gpu_model.parameters()).device
    if compiled:
        assert engine.wait_compiled(timeout=300), engine.compile_status()
    assert _serve(engine, gpu_model) == expected
    if compiled:
        status = engine.compile_status()
        assert status["state"] == "ready" and status["steps"] > 0, status

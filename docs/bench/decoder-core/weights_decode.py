"""float32 against float16 weights (quantize_dynamic fp16, float32 activations): SmolLM2 decode at batch 1 and 8 (BENCHMARKS.md, round three)."""
import copy, time, torch
from torch import nn
from torch.ao.quantization import quantize_dynamic
torch.set_num_threads(2)
from attnkit.models import load_smollm2, GenerationStats
m = load_smollm2()
q = quantize_dynamic(copy.deepcopy(m), {nn.Linear}, dtype=torch.float16)
ids = m.tokenize("The capital of France is")["input_ids"]
for name, model in [("f32", m), ("f16", q), ("f32", m), ("f16", q)]:
    st = GenerationStats(); model.generate(ids, max_new_tokens=48, stop_ids=[], stats=st)
    print(name, round(st.decode_tokens_per_s, 1))
texts = ["Tell me a story about a dragon", "Hi", "What is the capital of France and why is it famous?", "List three colours", "def add(a, b):", "Once upon a time", "The weather today is sunny and", "Why?"]
b = m.tokenize(texts)
for name, model in [("f32", m), ("f16", q)]:
    st = GenerationStats(); model.generate(b["input_ids"], b["attention_mask"], max_new_tokens=48, stop_ids=[], stats=st)
    print("b8", name, round(st.new_tokens * 8 / st.decode_seconds, 1))

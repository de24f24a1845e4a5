"""Decode speed of one attnkit checkout (PYTHONPATH picks it): batch 1 and 8 left-padded prompts (BENCHMARKS.md, round three)."""
import json, sys, time, torch
torch.set_num_threads(2)
from attnkit.models import GenerationStats, load_smollm2
m = load_smollm2()
out = {}
single = m.tokenize("The capital of France is")
texts = ["Tell me a story about a dragon", "Hi", "What is the capital of France and why is it famous?",
         "List three colours", "def add(a, b):", "Once upon a time", "The weather today is sunny and", "Why?"]
batch = m.tokenize(texts)
for name, b in [("b1", single), ("b8", batch)]:
    rates = []
    for _ in range(3):
        st = GenerationStats()
        m.generate(b["input_ids"], b["attention_mask"], max_new_tokens=48, stop_ids=[], stats=st)
        rates.append(st.new_tokens * b["input_ids"].shape[0] / max(st.decode_seconds, 1e-9))
    out[name] = sorted(rates)[1]
print(json.dumps(out))

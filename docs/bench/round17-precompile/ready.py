"""Time to a ready compiled serving step with PyTorch's experimental caching precompile (round seventeen).

    TORCH_CACHING_PRECOMPILE=1 OMP_NUM_THREADS=1 python docs/bench/round17-precompile/ready.py FOLDER

Run twice with the same FOLDER (cold, then warm): cold.txt and warm.txt. Both compiles failed (after 119.7 s
and 40.8 s): the float16 layers' fbgemm matrices cannot be pickled, so no warm start was timed.
"""

import sys
import time
from pathlib import Path

import torch

from attnkit.models.generation_options import GenerationOptions
from attnkit.models.loader import load_gguf, smollm2_path
from attnkit.serve import Engine
from attnkit.serve.compile_cache import CompileCache

torch.set_num_threads(1)
model = load_gguf(smollm2_path(), weights="int4")
cache = CompileCache.for_model(model, torch.float32, Path(sys.argv[1]))
start = time.monotonic()
engine = Engine(model, model.decode, kv_memory_mib=64, compile=True, compile_cache=cache)
ok = engine.wait_compiled(900)
print("ready", ok, round(time.monotonic() - start, 1), engine.compile_status(), flush=True)
tokens: list[int] = []
engine.submit(model.tokenizer.encode("Hello, my name is"), GenerationOptions(max_new_tokens=40),
              lambda event: tokens.extend(event.token_ids))
while not engine.idle:
    engine.step()
print("steps", engine.compile_status(), model.decode(tokens)[:80])

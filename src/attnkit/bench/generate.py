"""The generate suite: a real decoder's prefill and decode speed, attnkit beside transformers.

At batch 1 on SmolLM2-135M-Instruct (same weights, same dtype), for each
prompt length: prefill tokens/s and decode tokens/s of attnkit's generation
loop and of transformers' ``generate``, measured interleaved (one run of
each per round) and summarised by the median. In the same run, the machine's
decode bound: one pass of matrix-vector products over every weight matrix
of the model (a decoding step cannot read its weights faster), and the share
of teacher-forced positions of a fixed text where bfloat16's greedy choice
equals float32's. Memory: in a fresh process per contender, the resident set
with the model loaded, and the peak while it generates once (the peak counter
reset after loading, so the loader's transient buffers do not count).

    python -m attnkit.bench.generate            # prints a table
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnkit._optional import require

from .runner import cpu_record

_TEXT = ("The Roman Empire was the post-Republican state of ancient Rome. It is generally understood to mean "
         "the period and territory ruled by the Romans following Octavian's assumption of sole rule under the "
         "Principate in 27 BC. It included territories in Europe, North Africa, and Western Asia, and was "
         "ruled by emperors. The fall of the Western Roman Empire in 476 AD conventionally marks the end of "
         "classical antiquity and the beginning of the Middle Ages. ")


def _prompt(model: Any, length: int) -> Tensor:
    """A (1, length) prompt: the fixed text's ids, repeated as needed."""
    ids = model.tokenizer.encode(_TEXT)
    reps = -(-length // len(ids))
    return torch.tensor([(ids * reps)[:length]], dtype=torch.long)  # (1, T)


def _attnkit_run(model: Any, ids: Tensor, new_tokens: int) -> tuple[float, float]:
    from attnkit.models import GenerationStats

    stats = GenerationStats()
    model.generate(ids, max_new_tokens=new_tokens, stop_ids=[], stats=stats)
    return stats.prefill_tokens_per_s, stats.decode_tokens_per_s


def _hf_run(hf: Any, ids: Tensor, new_tokens: int) -> tuple[float, float]:
    """transformers' generate: prefill = a 1-token generate; decode = the rest of a full one."""
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=2)
    with torch.inference_mode():
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, **kw)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - start
    return ids.shape[1] / prefill, (new_tokens - 1) / max(total - prefill, 1e-9)


def decode_bound_seconds(model: Any, repeats: int = 5) -> float:
    """Median seconds of one matrix-vector product with every weight matrix (the head included)."""
    # every matrix as (out, in) rows, the layout F.linear and transformers use (attnkit keeps its
    # vocabulary matrix transposed, which reads faster: the bound does not get that advantage)
    mats = [(p.t() if n.endswith("weight_t") else p).contiguous() for n, p in model.named_parameters() if p.dim() == 2]
    vecs = [torch.randn(1, m.shape[1], dtype=m.dtype) for m in mats]
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for m, v in zip(mats, vecs, strict=True):
                torch.nn.functional.linear(v, m)  # (1, in) -> (1, out)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def greedy_agreement(reference: Any, other: Any, length: int = 256) -> float:
    """Share of teacher-forced positions of the fixed text where both models' argmax agree."""
    ids = _prompt(reference, length)
    with torch.inference_mode():
        a = reference(ids).argmax(-1)  # (1, T, V) -> (1, T)
        b = other(ids).argmax(-1)
    return float((a == b).double().mean())


def _median_rates(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def _load_hf(dtype: str) -> Any:
    """transformers' LlamaForCausalLM from the same GGUF file, in ``dtype``."""
    from attnkit.models.loader import smollm2_path

    transformers = require("transformers", "The generate benchmark's transformers contender")
    path = smollm2_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=_DTYPES[dtype]).eval()


def _contenders(model: Any, dtype: str, new_tokens: int, include_transformers: bool
                ) -> dict[str, Callable[[Tensor], tuple[float, float]]]:
    """attnkit in ``dtype``; transformers on the same weights in ``dtype`` and, for a half dtype, float32 too."""
    runs: dict[str, Callable[[Tensor], tuple[float, float]]] = {
        f"attnkit-{dtype}": lambda ids: _attnkit_run(model, ids, new_tokens)}
    if include_transformers:
        for name in dict.fromkeys([dtype, "float32"]):
            runs[f"transformers-{name}"] = functools.partial(_hf_run, _load_hf(name), new_tokens=new_tokens)
    return runs


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run_generate_suite(*, dtype: str = "float32", prompt_lens: tuple[int, ...] = (16, 512), new_tokens: int = 128,
                       repeats: int = 3, include_transformers: bool = True, memory: bool = True,
                       log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows (dicts): the bound, prefill and decode tokens/s per contender and prompt, peak memory, bf16
    agreement, and the targets they decide."""
    from attnkit.models import load_smollm2

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    say = log or (lambda _: None)
    model = load_smollm2(dtype=_DTYPES[dtype])
    contenders = _contenders(model, dtype, new_tokens, include_transformers)
    env = {"dtype": dtype, "threads": torch.get_num_threads(), "torch": torch.__version__, **cpu_record()}
    rows: list[dict[str, Any]] = []
    bound = decode_bound_seconds(model)
    rows.append({"kind": "bound", **env, "seconds_per_pass": bound, "decode_tokens_per_s": 1 / bound})
    for length in prompt_lens:
        ids = _prompt(model, length)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
        for run in contenders.values():  # warm-up
            run(ids[:, :8])
        for r in range(repeats):
            for name, run in contenders.items():  # interleaved: one run of each per round
                say(f"T={length} round {r + 1}/{repeats}: {name}")
                runs[name].append(run(ids))
        for name, results in runs.items():
            prefill, decode = _median_rates(results)
            peak = _peak_memory(name, length, new_tokens) if memory else None
            rows.append({"kind": "generate", **env, "contender": name, "prompt_len": length, "new_tokens": new_tokens,
                         "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode,
                         "decode_share_of_bound": decode * bound, **(peak or {})})
    reference = model if dtype == "float32" else load_smollm2()
    other = load_smollm2(dtype=torch.bfloat16) if dtype == "float32" else model
    rows.append({"kind": "bf16_agreement", **env, "positions": 256,
                 "agreement": greedy_agreement(reference, other)})
    return rows + generate_targets(rows)


def generate_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets these rows decide: each a row with its goal, measured value and verdict."""
    gen = {(r["contender"], r["prompt_len"]): r for r in rows if r["kind"] == "generate"}
    out = []

    def target(name: str, goal: str, value: float, met: bool) -> None:
        out.append({"kind": "target", "target": name, "goal": goal, "measured": round(value, 3), "met": met})

    for (name, length), row in gen.items():
        rate = row["decode_tokens_per_s"]
        hf32 = gen.get(("transformers-float32", length))
        if name == "attnkit-float32" and hf32 is not None:
            ratio = rate / hf32["decode_tokens_per_s"]
            target(f"T={length} float32 decode vs transformers float32", ">= 1.3x", ratio, ratio >= 1.3)
        if name == "attnkit-float32":
            target(f"T={length} float32 decode vs the measured bound", ">= 80%", row["decode_share_of_bound"],
                   row["decode_share_of_bound"] >= 0.8)
        if name == "attnkit-bfloat16" and hf32 is not None:
            ratio = rate / hf32["decode_tokens_per_s"]
            target(f"T={length} bfloat16 decode vs transformers float32", ">= 2x", ratio, ratio >= 2.0)
    for row in rows:
        if row["kind"] == "bf16_agreement":
            target("bfloat16 greedy choice = float32's (teacher-forced)", ">= 95%", row["agreement"],
                   row["agreement"] >= 0.95)
    return out


def _peak_memory(contender: str, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """Memory (MiB) of a fresh process that loads ``contender`` and generates once (see :func:`_measure_peak`)."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from attnkit.bench.generate import _measure_peak; "
            f"print(json.dumps(_measure_peak({contender!r}, {prompt_len}, {new_tokens})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _memory_kib(field: str) -> int:
    """A field of /proc/self/status (VmRSS now, VmHWM the peak since the last reset), in KiB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def _measure_peak(contender: str, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """In this process: resident memory with the model loaded, and the peak while it generates.

    The peak counter (VmHWM) is reset after loading (Linux: ``/proc/self/clear_refs``), so a
    loader's transient buffers do not hide the generation's own peak.
    """
    from attnkit.models import load_smollm2
    from attnkit.models.gguf import read_gguf
    from attnkit.models.llama import LlamaConfig
    from attnkit.models.loader import smollm2_path
    from attnkit.models.tokenizer import GGUFTokenizer

    kind, dtype = contender.split("-", 1)
    metadata = read_gguf(smollm2_path()).metadata
    tokenizer = GGUFTokenizer.from_metadata(metadata, context_length=LlamaConfig.from_metadata(metadata).context_length)
    ids = torch.tensor([(tokenizer.encode(_TEXT) * (prompt_len // 10 + 1))[:prompt_len]])  # (1, T)
    if kind == "attnkit":
        run = _contenders(load_smollm2(dtype=_DTYPES[dtype]), dtype, new_tokens, False)[contender]
    else:
        run = functools.partial(_hf_run, _load_hf(dtype), new_tokens=new_tokens)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the peak to the current resident set
    loaded = _memory_kib("VmRSS")
    run(ids)
    peak = _memory_kib("VmHWM")
    return {"loaded_rss_mib": round(loaded / 1024), "generate_peak_mib": round(peak / 1024),
            "generate_extra_mib": round((peak - loaded) / 1024)}


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of the suite's rows."""
    lines = []
    for row in rows:
        if row["kind"] == "bound":
            lines.append(f"decode bound ({row['dtype']}, {row['threads']} threads): "
                         f"{row['seconds_per_pass'] * 1e3:.1f} ms per pass of all weights = "
                         f"{row['decode_tokens_per_s']:.1f} tokens/s")
        elif row["kind"] == "bf16_agreement":
            lines.append(f"bf16 vs float32 greedy agreement on {row['positions']} teacher-forced positions: "
                         f"{row['agreement']:.1%}")
        elif row["kind"] == "target":
            lines.append(f"target {row['target']}: {row['goal']}, measured {row['measured']}: "
                         f"{'met' if row['met'] else 'MISSED'}")
        else:
            memory = (f", loaded {row['loaded_rss_mib']} MiB, +{row['generate_extra_mib']} MiB generating"
                      if "loaded_rss_mib" in row else "")
            lines.append(f"{row['contender']:>20} T={row['prompt_len']:>4} +{row['new_tokens']}: prefill "
                         f"{row['prefill_tokens_per_s']:8.1f} tok/s, decode {row['decode_tokens_per_s']:6.1f} tok/s "
                         f"({row['decode_share_of_bound']:.0%} of bound){memory}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out_dir: Any) -> list[Any]:
    """decode.png: decode tokens/s per contender and prompt length, beside the measured bound."""
    plt = require("matplotlib.pyplot", "The generate suite's plot")
    gen = [r for r in rows if r["kind"] == "generate"]
    bound = next((r["decode_tokens_per_s"] for r in rows if r["kind"] == "bound"), None)
    lengths = sorted({r["prompt_len"] for r in gen})
    names = list(dict.fromkeys(r["contender"] for r in gen))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        rates = [next((r["decode_tokens_per_s"] for r in gen if r["contender"] == name and r["prompt_len"] == t), 0)
                 for t in lengths]
        ax.bar([j + i * width for j in range(len(lengths))], rates, width, label=name)
    if bound is not None:
        ax.axhline(bound, color="black", linestyle=":", label=f"bound: one pass of all weights ({bound:.1f}/s)")
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(lengths))],
                  [f"prompt {t}" for t in lengths])
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(f"SmolLM2-135M decode, {gen[0]['dtype'] if gen else ''}, {gen[0]['threads'] if gen else ''} threads")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(out_dir) / "decode.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="The generate benchmark suite (SmolLM2-135M, batch 1).")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-lens", default="16,512")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()
    rows = run_generate_suite(dtype=args.dtype, prompt_lens=tuple(int(x) for x in args.prompt_lens.split(",")),
                              new_tokens=args.new_tokens, repeats=args.repeats,
                              include_transformers=not args.no_transformers, memory=not args.no_memory, log=print)
    print(format_rows(rows))


if __name__ == "__main__":
    main()

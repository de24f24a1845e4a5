"""The chunked kernel's in-place softcap: the sigmoid form it uses against tanh in place, as ratios to plain causal.

    .venv/bin/python docs/bench/round11-softcap/inplace_forms.py > docs/bench/round11-softcap/inplace_forms.txt

B=1, 9 query heads over 3 key/value heads of 64 (SmolLM2's), T=S=2048, causal, float32, forward, 2 threads;
medians of 7 interleaved rounds. Also each form's largest error against float64 cap * tanh(x / cap) over
scores in [-30, 30].
"""

from __future__ import annotations

import time

import torch

import attnkit
from attnkit.functional.modifiers import Softcap, softcap

CAP = 30.0


def tanh_in_place(self: Softcap, score: torch.Tensor, *idx: torch.Tensor) -> torch.Tensor:
    return score.div_(self.cap).tanh_().mul_(self.cap)


def main() -> None:
    torch.set_num_threads(2)
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, 2 threads")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 2048, 64, generator=gen)
    k, v = torch.randn(1, 3, 2048, 64, generator=gen), torch.randn(1, 3, 2048, 64, generator=gen)
    forms = {"sigmoid (used)": Softcap.modify_, "tanh in place": tanh_in_place}

    def run(mod: object) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            attnkit.attention(q, k, v, causal=True, score_mod=mod, backend="chunked")
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"plain causal": [], **{name: [] for name in forms}}
    try:
        for _ in range(7):
            times["plain causal"].append(run(None))
            for name, form in forms.items():
                Softcap.modify_ = form  # type: ignore[method-assign]
                times[name].append(run(softcap(CAP)))
    finally:
        Softcap.modify_ = forms["sigmoid (used)"]  # type: ignore[method-assign]
    plain = sorted(times["plain causal"])[3]
    x = torch.linspace(-30.0, 30.0, 6001).view(1, 1, 1, -1)  # (1, 1, 1, S) scores
    idx = tuple(torch.zeros(1, 1, 1, 1, dtype=torch.long) for _ in range(4))
    exact = CAP * torch.tanh(x.double() / CAP)
    for name, form in forms.items():
        median = sorted(times[name])[3]
        error = float((form(softcap(CAP), x.clone(), *idx).double() - exact).abs().max())
        print(f"{name}: {median * 1e3:.1f} ms, {median / plain:.2f}x plain causal ({plain * 1e3:.1f} ms); "
              f"largest error {error:.1e}")


if __name__ == "__main__":
    main()

"""``attnkit chat`` before and after it ran on the serving engine, then its ``--compile`` cold and warm.

    OMP_NUM_THREADS=2 python docs/bench/round18-chat/chat.py OLD_SRC NEW_SRC OUT_DIR

OLD_SRC, NEW_SRC: the ``src`` folders of two checkouts (``git worktree add /tmp/old 67292a7``). SmolLM2-135M-Instruct
in its default form, greedy, ``--max-new-tokens 100``, 2 threads, the same four messages piped to stdin.

1. Eager: a warm-up round, then ROUNDS rounds, each running ``python -m attnkit chat`` once per checkout
   (alternating, PYTHONPATH pointing at it); per turn, the median decode rate and the prompt tokens prefilled and
   found cached, read from each turn's speed line.
2. ``--compile`` on the new checkout, twice over one empty cache folder (ATTNKIT_CACHE and Inductor's): cold, then
   warm (the step kept on disk by the first run). Messages are sent one at a time until the chat says its compiled
   step is ready (how long the compile took, as the chat reports it), then three more; the decode rates of the
   turns before and after, with their conversation lengths.

Printed, and written to OUT_DIR/results.json with the CPU capability.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MESSAGES = ["Write a short story about a robot.", "Now make it longer.", "Give it a title.",
            "Summarise it in one sentence."]
ROUNDS, NEW = 3, 100
SPEED = re.compile(r"^prompt: (?:(\d+) tokens|prefilled (\d+) new tokens \((\d+) cached\)) in .* generation: (\d+) "
                   r"tokens, ([\d.]+) tokens/s")
READY = re.compile(r"compiled decoding step is ready after ([\d.]+) s")


def command(src: str, *extra: str) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": src, "COLUMNS": "200"}
    return [sys.executable, "-m", "attnkit", "chat", "--max-new-tokens", str(NEW), "--threads", "2", *extra], env


def turn(line: str) -> dict[str, Any] | None:
    m = SPEED.match(line)
    if m is None:
        return None
    fresh, new, cached, tokens, rate = m.groups()
    prefilled = int(fresh or new)
    return {"prefilled": prefilled, "cached": int(cached or 0), "tokens": int(tokens), "decode_tok_s": float(rate)}


def eager_run(src: str) -> list[dict[str, Any]]:
    args, env = command(src)
    done = subprocess.run(args, input="\n".join(MESSAGES) + "\n", capture_output=True, text=True, env=env,
                          timeout=900, check=True)
    turns = [t for t in map(turn, done.stderr.splitlines()) if t is not None]
    assert len(turns) == len(MESSAGES), done.stderr
    return turns


def compiled_run(src: str, cache: Path) -> dict[str, Any]:
    """One ``--compile`` chat: messages sent one at a time until three turns ran after the ready note. The note
    follows the speed line of the turn during which the compile ended, so a turn ran compiled throughout when the
    note was read before its own speed line."""
    args, env = command(src, "--compile")
    env = {**env, "ATTNKIT_CACHE": str(cache / "attnkit"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    process = subprocess.Popen(args, stdin=subprocess.PIPE, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               text=True, env=env)
    assert process.stdin is not None and process.stderr is not None
    turns: list[dict[str, Any]] = []
    ready, began = None, time.monotonic()
    for message in MESSAGES * 50:
        process.stdin.write(message + "\n")
        process.stdin.flush()
        while (line := process.stderr.readline()) and (found := turn(line)) is None:
            if (m := READY.search(line)) is not None:
                ready = float(m.group(1))
        assert line, "the chat ended before its turn was answered"
        found["compiled"] = ready is not None
        turns.append(found)
        if sum(t["compiled"] for t in turns) == 3:
            break
    process.stdin.close()
    process.wait(timeout=60)
    return {"ready_after_s": ready, "wall_s": round(time.monotonic() - began, 1), "turns": turns}


def main() -> None:
    old, new, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    results: dict[str, Any] = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "new_tokens": NEW,
                               "messages": MESSAGES, "eager": {"old": [], "new": []}}
    eager_run(old), eager_run(new)  # warm-up: page cache, the packaged model's files
    for _ in range(ROUNDS):
        for name, src in (("old", old), ("new", new)):
            results["eager"][name].append(eager_run(src))
    for name in ("old", "new"):
        runs = results["eager"][name]
        for i in range(len(MESSAGES)):
            rates = [run[i]["decode_tok_s"] for run in runs]
            first = runs[0][i]
            print(f"eager {name} turn {i + 1}: prefilled {first['prefilled']}, cached {first['cached']}, decode "
                  f"median {statistics.median(rates):.1f} tok/s ({', '.join(f'{r:.1f}' for r in rates)})")
    with tempfile.TemporaryDirectory() as folder:
        for kind in ("cold", "warm"):
            run = compiled_run(new, Path(folder))
            results[f"compile_{kind}"] = run
            eager = [t["decode_tok_s"] for t in run["turns"] if not t["compiled"]]
            compiled = [t["decode_tok_s"] for t in run["turns"] if t["compiled"]]
            print(f"--compile {kind}: ready after {run['ready_after_s']} s; eager turns "
                  f"{', '.join(f'{r:.1f}' for r in eager)} tok/s; compiled turns "
                  f"{', '.join(f'{r:.1f}' for r in compiled)} tok/s")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""The README's ring example runs under torchrun, as the README says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_shows_the_example_file_as_it_is():
    example = (ROOT / "examples" / "ring_example.py").read_text().strip()
    assert example in (ROOT / "README.md").read_text()


def test_ring_example_runs_under_torchrun_with_two_processes():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "examples" / "ring_example.py")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}/2: output (2, 8, 512, 64) equals single-process attention" in done.stdout

"""The lab's trainer under ``torchrun`` with DistributedDataParallel equals one process.

Two CPU processes (gloo) each take half of every global batch; DDP averages their gradients.
The result must be the run of one plain process with the same global batch, up to the order
of floating-point sums. The rendezvous (``--standalone``) runs on localhost.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from companion.lab import TrainConfig, build_model

REPO = Path(__file__).resolve().parents[1]

#: The tiny run: T5's bias table is a trainable parameter shared by every layer, so its
#: gradient goes through DDP's all-reduce too.
ARGS = ["train", "--scheme", "t5", "--d-model", "16", "--n-heads", "2", "--n-layers", "1",
        "--seq-len", "32", "--batch-size", "4", "--steps", "4", "--warmup", "1",
        "--dtype", "float64", "--no-eval"]
STEPS, LR = 4, 1e-2  # the run's steps and TrainConfig's default peak learning rate

# Tolerance on every parameter, from the arithmetic. In float64 the two runs do the same
# operations except the order of the gradient sums: one process sums the 128 tokens' terms
# at once, two processes sum 64 each and DDP adds the two halves. Reordering a sum of n terms
# changes it by at most about n * eps64 * sum |g_i| (eps64 = 2**-53 = 1.1e-16). The
# backward pass chains such sums (the 128 tokens, matrix products of inner size <= 256), so
# n = 1024 is a generous count; each token's term carries the 1/128 of the mean, so
# sum |g_i| is about one token's gradient entry, <~ 1 (and clipping to norm 1 only shrinks
# it): |dg| <~ 1024 * 1.1e-16 = 1.1e-13. AdamW's step u = m / (sqrt(v) + eps) moves by at
# most |dg| / eps for a gradient change dg (its worst case, at g near 0; eps = 1e-8), so a
# step of size lr changes a parameter by at most
# lr * |dg| / eps = 1e-2 * 1.1e-13 / 1e-8 = 1.1e-7, and S = 4 steps by 4.5e-7. (This does
# not bound how a difference made at one step changes the next steps' gradients; at the
# sizes measured, 3e-16 to 1.3e-15, that is far below it.) Rounded up: 1e-6.
PARAM_TOL = 1e-6
# The logged loss (bits per byte, the mean over the global batch at the last step): besides
# its own summation order (128 * eps64 * 8 bits, 1e-13), the parameters it is computed with
# differ by at most PARAM_TOL each; there are 7408 of them, so by at most
# sqrt(7408) * PARAM_TOL = 8.6e-5 in 2-norm, and with the loss's gradient norm there (2.0
# to 2.2 bits, measured) the loss by at most 1.9e-4. Rounded up: 1e-3. (Averaging the ranks'
# losses wrongly, a sum instead of a mean, would be off by 7 bits.)
LOSS_TOL = 1e-3


def _run(cmd: list[str], tmp: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    two, one = tmp_path / "two.pt", tmp_path / "one.pt"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
          "-m", "companion.lab", *ARGS, "--checkpoint", str(two)], tmp_path)
    _run([sys.executable, "-m", "companion.lab", *ARGS, "--checkpoint", str(one)], tmp_path)
    a = torch.load(one, map_location="cpu", weights_only=True)
    b = torch.load(two, map_location="cpu", weights_only=True)
    assert a["config"] == b["config"] and a["step"] == b["step"] == STEPS
    cfg = TrainConfig.from_dict(a["config"])
    assert cfg.lr == LR and cfg.dtype == "float64"
    start = build_model(cfg).state_dict()  # the seeded initial weights both runs began from
    assert a["model"].keys() == b["model"].keys() == start.keys()
    for name, p in a["model"].items():
        q = b["model"][name]
        assert p.dtype == q.dtype == torch.float64
        assert (p - q).abs().max().item() <= PARAM_TOL, name
        # Each tensor moved by far more than the tolerance (Adam moves a parameter by about
        # the sum of the learning rates, 0.027 here), so the comparison can fail.
        assert (p - start[name]).abs().max().item() > 1000 * PARAM_TOL, name
    assert [e["step"] for e in a["log"]] == [e["step"] for e in b["log"]] == [STEPS]
    for x, y in zip(a["log"], b["log"]):
        assert x["lr"] == y["lr"]
        assert abs(x["loss"] - y["loss"]) <= LOSS_TOL

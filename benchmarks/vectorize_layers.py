"""Which layers vectorize well over tasks: one MAML micro-batch of an AutoInt-style model
(self-attention over the F field rows, then a linear head) with each attention layer, under
`torch.func.vmap` (``vectorize=True``) and in a loop over tasks (``vectorize=False``).

Attention variants (same math, same weights; checked equal before timing, exit 1 if not):

- ``hand-written``: q, k, v projections, ``softmax(q k^T / sqrt(d)) v``, output projection;
- ``sdpa``: the same through ``torch.nn.functional.scaled_dot_product_attention``;
- ``nn.MultiheadAttention``: the module (``batch_first=True``, ``need_weights=False``).

Timed: the model's forward, ``inner_steps`` second-order inner steps on the head and the
outer backward (gmeta_ds's own `MetaLearner`), per micro-batch of ``--tasks`` tasks of
``--rows`` rows; the variants interleaved over ``--rounds`` rounds, the median reported, and
each variant's time as a ratio to ``hand-written`` under vmap (the baseline, run side by side
in this script). Results: ``benchmarks/results/vectorize_layers.json``; docs/api.md, "Writing
a model that vectorizes", quotes them.

Run from the repo root:  python benchmarks/vectorize_layers.py [--rounds 5] [--threads 2]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (sets the thread policy; the checkout on sys.path)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gmeta_ds as gm  # noqa: E402
from gmeta_ds.data.tasks import TaskBatch  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "vectorize_layers.json"
FIELDS, DIM, HEADS = 8, 16, 2


class AutoInt(nn.Module):
    """rows (N, F, d) -> (N,): one self-attention layer over the field rows, then a head."""

    def __init__(self, attention: str):
        super().__init__()
        self.attention = attention
        self.row_fields = [f"f{j}" for j in range(FIELDS)]
        self.mha = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.head = nn.Linear(FIELDS * DIM, 1)

    def _qkv(self, rows):
        q, k, v = nn.functional.linear(rows, self.mha.in_proj_weight, self.mha.in_proj_bias).chunk(3, dim=-1)
        split = lambda x: x.unflatten(-1, (HEADS, DIM // HEADS)).transpose(-3, -2)  # noqa: E731
        return split(q), split(k), split(v)

    def forward(self, rows):
        if self.attention == "nn.MultiheadAttention":
            h, _ = self.mha(rows, rows, rows, need_weights=False)
        else:
            q, k, v = self._qkv(rows)
            if self.attention == "sdpa":
                a = nn.functional.scaled_dot_product_attention(q, k, v)
            else:
                a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS), dim=-1) @ v
            h = nn.functional.linear(a.transpose(-3, -2).flatten(-2), self.mha.out_proj.weight,
                                     self.mha.out_proj.bias)
        return self.head(torch.relu(h + rows).flatten(start_dim=1)).squeeze(-1)


def batch(tasks: int, rows: int, generator) -> tuple[TaskBatch, tuple]:
    s, q = rows // 2, rows - rows // 2
    ids = lambda n: torch.zeros(tasks, n, FIELDS, dtype=torch.long)  # noqa: E731
    y = lambda n: (torch.rand(tasks, n, generator=generator) < 0.4).float()  # noqa: E731
    b = TaskBatch(ids(s), y(s), torch.ones(tasks, s), ids(q), y(q), torch.ones(tasks, q),
                  torch.arange(tasks))
    looked = (torch.randn(tasks, s, FIELDS, DIM, generator=generator),
              torch.randn(tasks, q, FIELDS, DIM, generator=generator))
    return b, looked


def learner(attention: str, vectorize: bool, inner_steps: int):
    torch.manual_seed(0)
    return gm.meta_learner(AutoInt(attention), "maml", inner_steps=inner_steps, inner_lr=0.1,
                           adapt="head.*", vectorize=vectorize)


def step(lrn, b, looked) -> float:
    lrn.zero_grad(set_to_none=True)
    out = lrn(b, looked)
    out.loss.backward()
    return float(out.loss.detach())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--inner-steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5, help="timed micro-batches per variant per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="There is a performance drop")
    b, looked = batch(args.tasks, args.rows, torch.Generator().manual_seed(0))
    variants = {(a, v): learner(a, v, args.inner_steps)
                for a in ("hand-written", "sdpa", "nn.MultiheadAttention") for v in (True, False)}
    losses = {key: step(lrn, b, looked) for key, lrn in variants.items()}
    grads = {key: lrn.net.mha.in_proj_weight.grad.clone() for key, lrn in variants.items()}
    ref = ("hand-written", True)
    for key in variants:
        if not (math.isclose(losses[key], losses[ref], rel_tol=1e-5)
                and torch.allclose(grads[key], grads[ref], rtol=1e-4, atol=1e-6)):
            print(f"FAIL: {key} computes another loss or gradient than {ref}: {losses[key]} vs {losses[ref]}")
            return 1
    times = {key: [] for key in variants}
    for _ in range(args.rounds):
        for key, lrn in variants.items():
            step(lrn, b, looked)  # warm
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step(lrn, b, looked)
            times[key].append((time.perf_counter() - t0) / args.iters)
    base = statistics.median(times[ref])
    rows = []
    for (attention, vectorize), ts in times.items():
        median = statistics.median(ts)
        rows.append({"attention": attention, "vectorize": vectorize, "ms_per_micro_batch": round(median * 1e3, 2),
                     "vs_hand_written_vmap": round(median / base, 2)})
        print(f"{attention:24s} {'vmap' if vectorize else 'loop':4s} {median * 1e3:8.2f} ms  "
              f"x{median / base:.2f} of hand-written under vmap")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: (str(v) if isinstance(v, Path) else v)
                                               for k, v in vars(args).items()},
                                    "torch": torch.__version__, "results": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo's meta-step compiled several ways against eager, in one process (issue 53 item 2).

One micro-batch as `gmeta-ds train` of examples/synthetic/config.yaml runs it, without DeepSpeed:
MeLU (embed 16, MLP 64-32), second-order MAML with 2 inner steps (lr 0.5) on ``mlp.*``, the
ranking term (rank_weight 1), the support prior (5) and the anchor term (init_weight 1), 32 tasks
of the synthetic data (support 83-88 rows, query 10), forward and outer backward. Variants
(``--variants``), each a `CompiledTasks`:

- ``dynamic``: one graph, row dimensions marked dynamic, inductor's Python wrapper;
- ``dynamic_cpp``: the same with inductor's C++ wrapper (``cpp_wrapper``: the default);
- ``static_cpp``: a static graph per bucket of lengths (`pad_to_buckets`), C++ wrapper;
- ``static``: static buckets, Python wrapper;
- ``static_autotune``: static buckets with ``max_autotune`` (C++ GEMM templates benchmarked
  against the library's matrix products per shape).

Each variant compiles first (untimed) into its own fresh inductor cache: its compile time is
cold. The first compiled variant's loss and gradients are checked against eager's (exit 1 past
1e-5). Then ``--rounds`` rounds run every variant ``--iters`` micro-batches in turn; each
round's median is reported as eager's time over the variant's (above 1: faster than eager).

    python benchmarks/compile_options.py [--variants dynamic dynamic_cpp static_cpp] [--rounds 3]

Writes ``benchmarks/results/compile_options.json``. Shared cores: read the rounds, not one
number.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # first: sets OMP_WAIT_POLICY before torch loads

# isort: split

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from inner_loop import make_batches, step

from gmeta_ds.algorithms.base import MetaLearner
from gmeta_ds.algorithms.maml import MAML
from gmeta_ds.config import EmbeddingConfig, SyntheticConfig
from gmeta_ds.data.synthetic import synthetic_fields
from gmeta_ds.functional.compiled import CompiledTasks
from gmeta_ds.models.melu import build_melu

RESULTS = Path(__file__).resolve().parent / "results" / "compile_options.json"
VARIANTS = {"dynamic": {"options": {}}, "dynamic_cpp": {}, "static_cpp": {"static": True},
            "static": {"static": True, "options": {}},
            "static_autotune": {"static": True, "options": {"max_autotune": True}}}


def demo_learner(net, how: dict | None) -> MetaLearner:
    """The demo's algorithm on ``net``; ``how``: `CompiledTasks` arguments, None: eager."""
    algorithm = MAML(2, 0.5, ["mlp.*"], vectorize=True, rank_weight=1.0, inner_loss_prior=5.0, init_weight=1.0)
    if how is not None:
        algorithm.compiled = CompiledTasks(**how)
    return MetaLearner(net, algorithm)


def compile_variant(net, learner, batches, cache: Path) -> dict:
    """Compile on every batch into a fresh cache; loss and gradients of the first batch."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    for b in batches[1:]:
        step(net, lambda b: learner(b).loss, b)
    loss = step(net, lambda b: learner(b).loss, batches[0])
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    c = learner.algorithm.compiled
    facts = {"compile_s": c.seconds, "graphs": c.graphs, "eager_fallback": c.failure} if c is not None else {}
    return {"loss": loss, "grads": grads, **facts}


def time_rounds(net, learners: dict, batches, rounds: int, iters: int) -> dict[str, list[float]]:
    """name -> per-round median seconds of one micro-batch (forward and outer backward)."""
    times = {name: [] for name in learners}
    for r in range(rounds):
        for name, learner in learners.items():
            ts = []
            for i in range(iters):
                net.zero_grad(set_to_none=True)
                start = time.perf_counter()
                learner(batches[i % len(batches)]).loss.backward()
                ts.append(time.perf_counter() - start)
            times[name].append(statistics.median(ts))
        print(f"round {r + 1}: " + ", ".join(f"{n} {1e3 * t[-1]:.1f} ms ({times['eager'][-1] / t[-1]:.2f}x)"
                                             for n, t in times.items()) + f"; load average {os.getloadavg()[0]:.2f}",
              flush=True)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["dynamic", "dynamic_cpp", "static_cpp"], choices=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    net = build_melu(synthetic_fields(SyntheticConfig()), 16, [64, 32], EmbeddingConfig(), seed=0)
    batches = make_batches(32, 4)
    learners = {"eager": demo_learner(net, None)}
    facts = {}
    with tempfile.TemporaryDirectory(prefix="compile_options_") as tmp:
        ref = compile_variant(net, learners["eager"], batches, Path(tmp) / "eager")
        for name in args.variants:
            learners[name] = demo_learner(net, VARIANTS[name])
            got = compile_variant(net, learners[name], batches, Path(tmp) / name)
            err = max((got["grads"][n] - ref["grads"][n]).abs().max().item() for n in ref["grads"])
            facts[name] = {k: got[k] for k in ("compile_s", "graphs", "eager_fallback")} | {"max_grad_diff": err}
            print(f"{name}: cold compile {got['compile_s']:.1f} s, {got['graphs']} graph(s), max gradient "
                  f"difference to eager {err:.1e}", flush=True)
            if err > 1e-5 or got["eager_fallback"]:
                print(f"{name}: gradients differ from eager's or it went eager ({got['eager_fallback']})", file=sys.stderr)
                return 1
        times = time_rounds(net, learners, batches, args.rounds, args.iters)
    rows = {name: {**facts.get(name, {}), "ms_per_round": [1e3 * t for t in ts],
                   "vs_eager_per_round": [e / t for e, t in zip(times["eager"], ts)]} for name, ts in times.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "threads": args.threads, "iters": args.iters,
                                    "shapes": [list(b.support_ids.shape) + [b.query_ids.shape[1]] for b in batches],
                                    "variants": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory per rank of few-shot text meta-training, ZeRO-2 vs ZeRO-3, at world 2.

Runs ``gmeta-ds train`` on ``examples/hf_fewshot/config.yaml`` under ``deepspeed --num_gpus 2``
for a few meta-steps (evaluation off) in three cases:

- ``example``: the example as configured (BERT 64 x 2, head-only adaptation);
- ``activations``: a wider BERT (512 x 4, ~13M parameters), MAML adapting every parameter:
  second-order activations dominate;
- ``state``: BERT 1024 x 6 (~80M parameters), head-only adaptation (ANIL), 1-shot 1-query
  episodes, 1 inner step: the dense state dominates.

Each rank reports its VmHWM after the training loop (``peak_rss_mib_per_rank`` in
summary.json). Next to it: the analytic dense state per rank between micro-steps
(`gmeta_ds.ds_config.dense_state_bytes`: parameters, gradients, Adam state) and the full fp32
parameters a ZeRO-3 rank gathers during each micro-step.

    python benchmarks/hf_memory.py [--steps 3]   (-> benchmarks/results/hf_memory.json)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BIN, REPO, free_port, machine, run_group

RESULTS = REPO / "benchmarks" / "results" / "hf_memory.json"


CASES = {  # name: (hidden, layers, extra --set overrides)
    "example": (64, 2, []),
    "activations": (512, 4, ["meta.adapt=['*']", "meta.inner_steps=2", "meta.inner_lr=0.5",
                             "meta.tasks_per_micro_batch=4", "meta.tasks_per_meta_step=8"]),
    "state": (1024, 6, ["meta.inner_steps=1", "text.data.shots=1",
                        "text.data.queries=1"]),
}


def run(case: str, stage: int, steps: int, out: Path, timeout: float) -> dict:
    from gmeta_ds.ds_config import dense_state_bytes

    hidden, layers, extra = CASES[case]
    model = (f"text.model.config={{model_type: bert, hidden_size: {hidden}, num_hidden_layers: {layers}, "
             f"num_attention_heads: 4, intermediate_size: {4 * hidden}}}")
    sets = [f"output_dir={out}", f"train.meta_steps={steps}", "train.log_every=1", "train.progress=false",
            "train.tensorboard=false", "eval.enabled=false", model, *extra,
            f"deepspeed=ds_configs/zero{stage}.json"]
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(BIN / "gmeta-ds"), "train", "--config", "examples/hf_fewshot/config.yaml",
           *[a for s in sets for a in ("--set", s)]]
    start = time.perf_counter()
    run_group(cmd, timeout, f"ZeRO-{stage} hidden {hidden} x {layers} layers")
    summary = json.loads((out / "summary.json").read_text())
    n = summary["parameters"]
    state = dense_state_bytes(summary["ds_config"], n, 2)
    return {"case": case, "stage": stage, "hidden": hidden, "layers": layers, "parameters": n,
            "wall_s": time.perf_counter() - start,
            "training_vmhwm_mib_per_rank": [r["training_vmhwm_mib"] for r in summary["peak_rss_mib_per_rank"]],
            "dense_state_mib_between_steps": sum(state[k] for k in ("params", "grads", "optimizer")) / 2**20,
            "gathered_params_mib_during_step": (4 * n / 2**20) if stage == 3 else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--timeout", type=float, default=400.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            for stage in (2, 3):
                rows.append(run(case, stage, args.steps, Path(tmp) / f"{case}_z{stage}", args.timeout))
    print("| case | model | parameters | ZeRO | peak RSS per rank (MiB) | dense state per rank "
          "between steps (MiB) | + gathered during a step (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peaks = " / ".join(f"{x:.0f}" for x in r["training_vmhwm_mib_per_rank"])
        print(f"| {r['case']} | BERT {r['hidden']} x {r['layers']} | {r['parameters'] / 1e6:.2f}M | {r['stage']} "
              f"| {peaks} | {r['dense_state_mib_between_steps']:.1f} | {r['gathered_params_mib_during_step']:.1f} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "world_size": 2, "steps": args.steps, "runs": rows},
                                  indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of the PyTorch-runtime test (test_torch_bridge.py): trains a small MLP a few SGD steps with each
schedule on CPU/gloo and writes the losses to OUT (rank-holding-the-last-stage's view) as JSON.

    python3 torch_worker.py RANK WORLD INIT_FILE OUT CASES_JSON

CASES_JSON: [{"label": ..., "runner": "pipetrain" | "torch", "schedule": name, "microbatches": m}, ...].
"pipetrain" runs pipetrain.schedule(name) through pipetrain.torch.pipeline_schedule (PyTorch's
_PipelineScheduleRuntime); "torch" runs PyTorch's own class for the same schedule.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import pipetrain
import pipetrain.torch as pttorch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as ts

LAYERS = 8
WIDTH = 16
BATCH = 16
STEPS = 4
LR = 0.05


def full_model():
    torch.manual_seed(1234)
    layers = []
    for i in range(LAYERS):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if i + 1 < LAYERS:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def chunks(model, n):
    """The model cut into n stages of equal layer counts (Linear + Tanh pairs)."""
    mods = list(model)
    bounds = []
    start = 0
    pairs = LAYERS // n
    for s in range(n):
        end = min(len(mods), start + 2 * pairs) if s + 1 < n else len(mods)
        bounds.append((start, end))
        start = end
    return [nn.Sequential(*mods[a:b]) for a, b in bounds]


def data():
    g = torch.Generator().manual_seed(99)
    xs = [torch.randn(BATCH, WIDTH, generator=g) for _ in range(STEPS)]
    ys = [torch.randn(BATCH, WIDTH, generator=g) for _ in range(STEPS)]
    return xs, ys


def run_case(case, rank, world):
    m = case["microbatches"]
    name = case["schedule"]
    # Each micro-batch's loss is its mean over 1/m of the batch: the summed gradients are those of the
    # full batch's mean (PyTorch 2.6 sums micro-batch gradients; newer ones can scale: scale_grads=False).
    mse = nn.MSELoss()

    def loss_fn(out, target):
        return mse(out, target) / m

    extra = {}
    if case["runner"] == "pipetrain":
        sched = pipetrain.schedule(name, stages=world, microbatches=m, virtual=case.get("virtual", 1))
        num_stages = sched.stages
        mine = pttorch.stages_of(sched, rank)
    else:
        num_stages = world * (2 if name in ("zb-v", "interleaved") else 1)
        mine = [rank, 2 * world - 1 - rank] if name == "zb-v" else (
            [rank, rank + world] if name == "interleaved" else [rank])
    import inspect
    cls = ts._PipelineScheduleRuntime if case["runner"] == "pipetrain" else {
        "gpipe": ts.ScheduleGPipe, "1f1b": ts.Schedule1F1B, "zb-v": ts.ScheduleZBVZeroBubble,
        "interleaved": ts.ScheduleInterleaved1F1B}[name]
    if "scale_grads" in inspect.signature(cls.__init__).parameters:
        extra["scale_grads"] = False
    if case["runner"] == "torch" and name == "zb-v":  # PyTorch 2.6's ZBV needs the V placement spelled out
        extra["stage_index_to_group_rank"] = {s: min(s, 2 * world - 1 - s) for s in range(2 * world)}
    parts = chunks(full_model(), num_stages)
    mods = {i: parts[i] for i in mine}
    stages = [PipelineStage(mods[i], i, num_stages, torch.device("cpu")) for i in sorted(mine)]
    if case["runner"] == "pipetrain":
        runtime = pttorch.pipeline_schedule(sched, stages, loss_fn=loss_fn, **extra)
    elif len(stages) == 1:
        runtime = cls(stages[0], m, loss_fn=loss_fn, **extra)
    else:
        runtime = cls(stages, m, loss_fn=loss_fn, **extra)
    params = [p for mod in mods.values() for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    xs, ys = data()
    holds_first, holds_last = 0 in mine, num_stages - 1 in mine
    step_losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses = []
        args = (xs[step],) if holds_first else ()
        kwargs = {"target": ys[step], "losses": losses} if holds_last else {}
        runtime.step(*args, **kwargs)
        opt.step()
        if holds_last:
            step_losses.append(float(sum(l.item() for l in losses)))
    # The trained weights, gathered as a checksum per stage, so a rank without the last stage checks too.
    weights = {str(i): float(sum(p.double().sum().item() for p in mods[i].parameters())) for i in mine}
    return {"losses": step_losses if holds_last else None, "weights": weights}


def main():
    import faulthandler

    # A rank that hangs prints every thread's stack before the test's own timeout kills it.
    faulthandler.dump_traceback_later(int(os.environ.get("PIPETRAIN_WORKER_DUMP_S", "200")), exit=True)
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, out_path = sys.argv[3], sys.argv[4]
    cases = json.loads(sys.argv[5])
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    results = {}
    try:
        for case in cases:
            print(f"rank {rank}: {case['label']}", file=sys.stderr, flush=True)
            results[case["label"]] = run_case(case, rank, world)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()

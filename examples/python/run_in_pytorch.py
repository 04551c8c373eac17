"""Train with a pipetrain schedule (V-Min by default) inside PyTorch's own pipelining runtime.

    PYTHONPATH=build/python python3 examples/python/run_in_pytorch.py [--schedule v-min] [--ranks 2]

Starts --ranks processes (CPU, gloo); each builds its PipelineStages for the stages pipetrain's schedule
puts on its rank and lets pipetrain.torch hand the schedule to torch.distributed.pipelining. Needs
PyTorch 2.5 or newer (Debian 13's python3-torch). Prints the loss per step next to the same model trained
without pipelining.
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

import pipetrain
import pipetrain.torch as pttorch

WIDTH, LAYERS, BATCH, STEPS, LR = 32, 8, 64, 5, 0.05


def model():
    torch.manual_seed(0)
    layers = []
    for i in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH)] + ([nn.Tanh()] if i + 1 < LAYERS else [])
    return nn.Sequential(*layers)


def cut(seq, parts):
    """parts slices of (Linear, Tanh) pairs."""
    mods, per = list(seq), 2 * (LAYERS // parts)
    return [nn.Sequential(*mods[i * per:(i + 1) * per if i + 1 < parts else len(mods)]) for i in range(parts)]


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)) for _ in range(STEPS)]


def rank_main(rank, world, name, m, init):
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    s = pipetrain.schedule(name, stages=world, microbatches=m)
    chunks = cut(model(), s.stages)
    mine = pttorch.stages_of(s, rank)
    stages = [PipelineStage(chunks[i], i, s.stages, torch.device("cpu")) for i in mine]
    mse = nn.MSELoss()
    runtime = pttorch.pipeline_schedule(s, stages, loss_fn=lambda out, y: mse(out, y) / m)  # full-batch mean
    opt = torch.optim.SGD([p for i in mine for p in chunks[i].parameters()], lr=LR)
    for step, (x, y) in enumerate(batches()):
        opt.zero_grad()
        losses = []
        args = (x,) if 0 in mine else ()
        kwargs = {"target": y, "losses": losses} if s.stages - 1 in mine else {}
        runtime.step(*args, **kwargs)
        opt.step()
        if losses:
            print(f"step {step}: loss {sum(l.item() for l in losses):.6f} ({name} in PyTorch's runtime, rank {rank})",
                  flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="v-min")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    a = ap.parse_args()
    print(pipetrain.simulate(a.schedule, stages=a.ranks, microbatches=a.microbatches).table(), end="")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(a.ranks, a.schedule, a.microbatches, os.path.join(d, "init")), nprocs=a.ranks)
    ref = model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step, (x, y) in enumerate(batches()):
        opt.zero_grad()
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.6f} (unpipelined)")


if __name__ == "__main__":
    sys.exit(main())

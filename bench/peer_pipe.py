#!/usr/bin/python3
"""PyTorch's own Pipe (torch.distributed.pipeline.sync.Pipe, the upstreamed torchgpipe) training the
same GPT as `pipetrain train --model gpt`: the peer of the issue-3 runtime benchmark.

Run with Debian's interpreter (python3-torch 1.13, the same LibTorch and BLAS as pipetrain):

    /usr/bin/python3 bench/peer_pipe.py --layers 8 --d-model 256 --heads 4 --vocab 96 --seq-len 128 \
        --batch-size 32 --microbatches 4 --steps 10 --threads 2 --partitions 2

The model is pipetrain's zoo GPT written in Python (zoo_gpt.py): [token + position embedding] [pre-norm block with
causal self-attention and a GELU MLP 4x] * layers [LayerNorm + head without bias], built in the same
order, each layer from the seed pipetrain's ranks build it with, so its initial weights equal LibTorch's; the data replays
zoo::make_synthetic_tokens (seed + 1) with the same generator calls, so step 1's loss should equal
pipetrain's to print precision (a check that both train the same thing). The layers+2 pipeline layers
are cut like pipetrain's uniform balance (layer counts, the remainder on the first partitions), one
nn.Sequential per partition; chunks = micro-batches, checkpoint='never', Adam lr 1e-3.

Running PyTorch's Pipe on CPU: rpc must be initialised (one worker) with the uv transport and basic
channels, or TensorPipe busy-polls a core; forward returns an RRef; on CPU all partitions share one worker thread, so Pipe runs
GPipe serially: the speed a CPU user of Pipe gets, not a parallel pipeline.

Prints per-step times and a final JSON line with the median step ms (first 2 steps skipped).
--quick (the `make test` run): tiny defaults (2 layers, d-model 32, 2 heads, seq-len 16, batch 8,
2 micro-batches, 3 steps); flags given explicitly still apply.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipeline.sync import Pipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_gpt import SyntheticTokens, make_layers, pipetrain_parameter_count  # noqa: E402


def uniform(n, parts):
    return [n // parts + (1 if s < n % parts else 0) for s in range(parts)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=96)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4, help="Pipe chunks")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--partitions", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, 3 steps (the make test run)")
    a = p.parse_args()
    if a.quick:  # tiny defaults; explicit flags win
        quick = dict(layers=2, d_model=32, heads=2, seq_len=16, batch_size=8, microbatches=2, steps=3)
        given = {x.split("=")[0] for x in sys.argv[1:] if x.startswith("--")}
        for k, v in quick.items():
            if "--" + k.replace("_", "-") not in given:
                setattr(a, k, v)
    if a.d_model % a.heads or a.microbatches > a.batch_size or a.steps < 1:
        p.error("need d_model % heads == 0, microbatches <= batch size, steps >= 1")

    torch.set_num_threads(a.threads)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}", _transports=["uv"],
                                           _channels=["basic"])
    rpc.init_rpc("worker", rank=0, world_size=1, rpc_backend_options=opts)
    try:
        layers = make_layers(a)
        balance = uniform(len(layers), a.partitions)
        parts, i = [], 0
        for n in balance:
            parts.append(nn.Sequential(*layers[i:i + n]))
            i += n
        model = Pipe(nn.Sequential(*parts), chunks=a.microbatches, checkpoint="never")
        params = sum(q.numel() for q in model.parameters())
        expected = pipetrain_parameter_count(a)
        with open("/proc/self/maps") as maps:  # the BLAS library actually loaded
            blas = sorted({l.split()[-1] for l in maps if "blas" in l.lower() and "/" in l}) or ["?"]
        print(f"peer_pipe: PyTorch {torch.__version__} Pipe, {a.partitions} partitions balance {balance}, "
              f"chunks {a.microbatches}, checkpoint never, {torch.get_num_threads()} thread(s)")
        print(f"  parameters: Pipe model {params}, pipetrain gpt {expected} ({'equal' if params == expected else 'DIFFERENT'})")
        print(f"  BLAS loaded: {', '.join(blas)}")
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        data = SyntheticTokens(a.vocab, a.seq_len, a.seed + 1)
        times = []
        for step in range(a.steps):
            x, y = data.batch(step, a.batch_size)
            t0 = time.perf_counter()
            out = model(x).local_value()
            loss = F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ms = (time.perf_counter() - t0) * 1000
            times.append(ms)
            print(f"step {step + 1:4d}/{a.steps}  loss {loss.item():.4f}  {ms:.1f} ms  "
                  f"{1000 * a.batch_size / ms:.1f} samples/s", flush=True)
        timed = times[min(2, len(times) - 1):]
        print(json.dumps({"bench": "peer_pipe", "threads": a.threads, "partitions": a.partitions,
                          "microbatches": a.microbatches, "batch_size": a.batch_size, "parameters": params,
                          "pipetrain_parameters": expected, "steps": a.steps,
                          "median_step_ms": round(statistics.median(timed), 3),
                          "min_step_ms": round(min(timed), 3), "max_step_ms": round(max(timed), 3)}))
    finally:
        rpc.shutdown()


if __name__ == "__main__":
    sys.exit(main())

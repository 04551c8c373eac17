#!/usr/bin/python3
"""The GPT of `pipetrain train --model gpt --stages 1` in plain PyTorch: the reference a GPU user compares
pipetrain against (issue 26's benchmark), eager or under torch.compile.

    python3 bench/gpt_reference.py --device cuda --layers 8 --d-model 512 --heads 8 --seq-len 256 \
        --vocab 256 --batch-size 32 --microbatches 4 --steps 30 [--compile] [--precision bf16]

One step does what pipetrain's one-stage step does: the batch cut into --microbatches micro-batches, each
one's forward and backward with its loss divided by their count (gradients accumulate), the gradients'
norm clipped to 1.0, one Adam step (PyTorch's default implementation for the device: for-each kernels on
a GPU; --fused: fused=True). The model and data are zoo_gpt.py's (pipetrain's zoo GPT and its synthetic
tokens, seed + 1 as `pipetrain train` uses), so the first step's loss should equal pipetrain's.

Each step is timed to a device synchronisation. Prints per-step lines and a final JSON line with the
median step ms over the steps after --skip (compilation happens in the first ones).
--quick (the `make test` run): the CPU, tiny sizes, 4 steps; flags given explicitly still apply.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_gpt import SyntheticTokens, make_layers, pipetrain_parameter_count  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=96)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=3, help="steps left out of the median (warm-up, compilation)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (PyTorch 2.x)")
    p.add_argument("--fused", action="store_true", help="Adam(fused=True) (PyTorch 2.x on a GPU)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0: as PyTorch starts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="the CPU, tiny sizes, 4 steps (the make test run)")
    a = p.parse_args()
    if a.quick:  # tiny defaults; explicit flags win
        quick = dict(layers=1, d_model=32, heads=2, seq_len=16, vocab=32, batch_size=8, microbatches=2, steps=4,
                     skip=1)
        given = {x.split("=")[0] for x in sys.argv[1:] if x.startswith("--")}
        for k, v in quick.items():
            if "--" + k.replace("_", "-") not in given:
                setattr(a, k, v)
    if a.d_model % a.heads or not 1 <= a.microbatches <= a.batch_size or a.steps <= a.skip or a.skip < 0:
        p.error(f"need d_model % heads == 0 (got {a.d_model} % {a.heads}), 1 <= microbatches <= batch size "
                f"(got {a.microbatches}, {a.batch_size}) and 0 <= skip < steps (got {a.skip}, {a.steps})")
    if a.compile and not hasattr(torch, "compile"):
        p.error(f"--compile needs PyTorch 2.x; this is {torch.__version__}")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: this PyTorch ({torch.__version__}) sees no CUDA device")
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    model = nn.Sequential(*make_layers(a)).to(device)
    params = sum(q.numel() for q in model.parameters())
    expected = pipetrain_parameter_count(a)
    run = torch.compile(model) if a.compile else model
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, **({"fused": True} if a.fused else {}))
    data = SyntheticTokens(a.vocab, a.seq_len, a.seed + 1)
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if a.precision == "bf16"
                else None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"gpt_reference: PyTorch {torch.__version__} on {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
          f"{'torch.compile' if a.compile else 'eager'}, {a.precision}, Adam{' fused' if a.fused else ''}, "
          f"m={a.microbatches}, {torch.get_num_threads()} thread(s)")
    print(f"  parameters: {params} (pipetrain gpt {expected}: {'equal' if params == expected else 'DIFFERENT'})")
    times, losses = [], []
    for step in range(a.steps):
        x, y = data.batch(step, a.batch_size)
        x, y = x.to(device), y.to(device)
        sync()
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for xs, ys in zip(x.chunk(a.microbatches), y.chunk(a.microbatches)):
            if autocast is not None:
                with autocast:
                    out = run(xs)
            else:
                out = run(xs)
            loss = F.cross_entropy(out.float().reshape(-1, out.size(-1)), ys.reshape(-1)) / a.microbatches
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        ms = (time.perf_counter() - t0) * 1000
        times.append(ms)
        losses.append(total.item())
        print(f"step {step + 1:4d}/{a.steps}  loss {losses[-1]:.4f}  {ms:.1f} ms  "
              f"{1000 * a.batch_size * a.seq_len / ms:.0f} tokens/s", flush=True)
    timed = times[a.skip:]
    median = statistics.median(timed)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    print(json.dumps({"bench": "gpt_reference", "torch": torch.__version__, "device": str(device),
                      "mode": "compile" if a.compile else "eager", "precision": a.precision, "fused_adam": a.fused,
                      "microbatches": a.microbatches, "batch_size": a.batch_size, "parameters": params,
                      "steps": a.steps, "skip": a.skip, "first_loss": round(losses[0], 4),
                      "last_loss": round(losses[-1], 4), "median_step_ms": round(median, 3),
                      "min_step_ms": round(min(timed), 3), "max_step_ms": round(max(timed), 3),
                      "tokens_per_s": round(1000 * a.batch_size * a.seq_len / median),
                      "peak_allocated_mib": None if peak is None else round(peak, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plan a profiled model: balances, the plan search, PipeDream's planner and UMPIPE, from Python.

    PYTHONPATH=build/python python3 examples/python/plan_profile.py [PROFILE] [--ranks 4]

PROFILE: pipetrain's profile JSON (pipetrain profile --out) or PipeDream's graph text; default the VGG-16
profile PipeDream ships (data/pipedream/vgg16-graph.txt, profiled at batch 128).
"""

import argparse
import json
import os

import pipetrain

HERE = os.path.dirname(os.path.abspath(__file__))
VGG = os.path.join(HERE, "..", "..", "data", "pipedream", "vgg16-graph.txt")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", nargs="?", default=VGG)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--bandwidth", type=float, default=10.0, help="GB/s between ranks")
    ap.add_argument("--batch-size", type=int, default=256,
                    help="samples per mini-batch (UMPIPE's global-dp grows with its square: 1024 takes ~40 s)")
    ap.add_argument("--generations", type=int, default=30, help="UMPIPE's genetic search, at most")
    ap.add_argument("--out", help="write the plan file here (pipetrain train --plan FILE runs it)")
    a = ap.parse_args()

    if a.profile == VGG:  # PipeDream's format does not record its batch size
        prof = pipetrain.parse_pipedream_graph(open(VGG).read(), micro_batch_size=128)
    else:
        prof = pipetrain.load_profile(a.profile)
    print(f"{prof['model']}: {len(prof['layers'])} layers at micro-batch {prof['micro_batch_size']}")

    for kind in ("uniform", "parameters", "time", "memory"):
        b = pipetrain.balance(prof, a.ranks, kind=kind)
        print(f"  balance {kind:<10} {b}  bottleneck {pipetrain.bottleneck(pipetrain.balance_costs(prof, 'time'), b):.1f} ms")

    res = pipetrain.search_plans(prof, ranks=a.ranks, bandwidth=a.bandwidth, batch_size=a.batch_size)
    best = res["chosen"]
    print(f"chosen: {best['stages']} stages x {best['replicas']} replicas, {best['schedule']} m={best['m']} "
          f"balance {best['balance']} ({best['kind']}), {best['makespan']:.1f} ms per mini-batch of "
          f"{res['batch_size']}, bubble {best['bubble']:.3f}")
    if res["uniform_1f1b"]:
        print(f"  {res['uniform_1f1b']['makespan'] / best['makespan']:.2f}x uniform 1f1b, "
              f"{res['data_parallel']['ms'] / best['makespan']:.2f}x data parallelism")

    pd = pipetrain.plan_pipedream(prof, ranks=a.ranks, bandwidth=a.bandwidth)
    print(f"PipeDream's planner: balance {pd['balance']} x replication {pd['replication']}, "
          f"{pd['speedup_over_data_parallel']:.2f}x its data parallelism")

    # UMPIPE: every stage cuts the mini-batch its own way (a small genetic search here: --generations).
    for u in pipetrain.umpipe(prof, balance=res["best_straight"]["balance"], samples=int(res["batch_size"]), bandwidth=a.bandwidth,
                              generations=a.generations):
        sizes = u["forward"][0]
        print(f"  umpipe {u['planner']:<13} {u['step_ms']:10.2f} ms  stage 0: {len(sizes)} forward micro-batches "
              f"of {min(sizes)}..{max(sizes)} samples")

    # The best single pipeline simulated again (the search's micro-batch size and transfers): the per-stage
    # table. (A hybrid plan adds its replicas' all-reduce, which simulate does not model.)
    one = res["best_straight"]
    sim = pipetrain.simulate(one["schedule"], stages=one["stages"], microbatches=one["m"], profile=prof,
                             virtual=one["virtual_stages"], balance=",".join(map(str, one["balance"])),
                             bandwidth=a.bandwidth, latency=50, microbatch_size=one["samples"] / one["m"])
    print(f"best single pipeline simulated again: {sim.makespan:.1f} ms (the search's {one['makespan']:.1f} ms)")
    print(sim.table(), end="")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res["plan_file"], f, indent=2)
        print(f"plan written to {a.out}")


if __name__ == "__main__":
    main()

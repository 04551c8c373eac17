"""pipetrain.torch: pipetrain's schedules run by PyTorch's own pipelining runtime (_PipelineScheduleRuntime)
on CPU with gloo, 2 processes. A small MLP trains 4 SGD steps with each schedule; the losses and trained
weights must match the same model trained without pipelining within 1e-5, and PyTorch's own class for the
schedules both have and that run under gloo here (gpipe; see test_same_losses_as_pytorchs_own_classes).

Needs torch.distributed.pipelining (PyTorch 2.5 or newer; Debian 13's python3-torch 2.6). Skipped, with
the reason, where the installed PyTorch lacks it (Debian 12's 1.13): `make test-libtorch2` runs it in
the Debian 13 root. PIPETRAIN_TORCH_REPORT=FILE writes the losses there as JSON.
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import pipetrain
import support

try:
    import torch
    from torch.distributed.pipelining import schedules as _ts  # noqa: F401

    HAVE_PIPELINING = hasattr(_ts, "_PipelineScheduleRuntime")
    WHY = "" if HAVE_PIPELINING else f"PyTorch {torch.__version__} has no _PipelineScheduleRuntime"
except ImportError as e:  # no torch, or one older than 2.4
    HAVE_PIPELINING = False
    WHY = f"no torch.distributed.pipelining here ({e}); make test-libtorch2 runs this with PyTorch 2.6"

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
CASES = [
    {"label": "pipetrain v-min", "runner": "pipetrain", "schedule": "v-min", "microbatches": 4},
    {"label": "pipetrain v-half", "runner": "pipetrain", "schedule": "v-half", "microbatches": 4},
    {"label": "pipetrain zb-h1", "runner": "pipetrain", "schedule": "zb-h1", "microbatches": 4},
    {"label": "pipetrain interleaved-zb", "runner": "pipetrain", "schedule": "interleaved-zb", "microbatches": 4,
     "virtual": 2},
    {"label": "pipetrain zb-v", "runner": "pipetrain", "schedule": "zb-v", "microbatches": 4},
    {"label": "pipetrain 1f1b", "runner": "pipetrain", "schedule": "1f1b", "microbatches": 4},
    {"label": "pipetrain gpipe", "runner": "pipetrain", "schedule": "gpipe", "microbatches": 4},
    {"label": "torch gpipe", "runner": "torch", "schedule": "gpipe", "microbatches": 4},
]


def reference(num_stages):
    """The unpipelined run: the whole model, whole batch, same SGD steps; losses and per-stage checksums."""
    sys.path.insert(0, HERE)
    import torch_worker as w

    torch.set_default_dtype(torch.float64)
    model = w.full_model()
    opt = torch.optim.SGD(model.parameters(), lr=w.LR)
    xs, ys = w.data()
    losses = []
    for step in range(w.STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs[step]), ys[step])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    parts = w.chunks(model, num_stages)
    weights = {str(i): float(sum(p.double().sum().item() for p in part.parameters())) for i, part in enumerate(parts)}
    return losses, weights


@unittest.skipUnless(HAVE_PIPELINING, WHY)
class TorchRuntime(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                       OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
            procs, outs = [], []
            for rank in range(WORLD):
                out = os.path.join(d, f"rank{rank}.json")
                outs.append(out)
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.join(HERE, "torch_worker.py"), str(rank), str(WORLD),
                     os.path.join(d, "init"), out, json.dumps(CASES)],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            logs = []
            for p in procs:
                try:
                    logs.append(p.communicate(timeout=240)[0])
                except subprocess.TimeoutExpired:
                    for q in procs:
                        q.kill()
                    raise AssertionError("a rank did not finish in 240 s (deadlock?)")
            if any(p.returncode != 0 for p in procs):
                raise AssertionError("\n".join(f"rank {r} exited {p.returncode}:\n{logs[r][-3000:]}"
                                               for r, p in enumerate(procs)))
            cls.results = []
            for out in outs:
                with open(out) as f:
                    cls.results.append(json.load(f))
        cls.ref = {n: reference(n) for n in (WORLD, 2 * WORLD)}
        report = os.environ.get("PIPETRAIN_TORCH_REPORT")
        if report:
            rows = {c["label"]: cls.losses(c["label"]) for c in CASES}
            rows["unpipelined"] = cls.ref[WORLD][0]
            with open(report, "w") as f:
                json.dump({"torch": torch.__version__, "losses": rows}, f, indent=1)

    @classmethod
    def losses(cls, label):
        found = [r[label]["losses"] for r in cls.results if r[label]["losses"] is not None]
        assert len(found) == 1, f"{label}: {len(found)} ranks report losses"
        return found[0]

    def test_losses_match_the_unpipelined_model(self):
        want = self.ref[WORLD][0]
        for case in CASES:
            with self.subTest(case=case["label"]):
                got = self.losses(case["label"])
                self.assertEqual(len(got), len(want))
                for a, b in zip(got, want):
                    self.assertAlmostEqual(a, b, delta=1e-5)
        self.assertLess(want[-1], want[0])  # it learns: the comparison is not between constants

    def test_weights_match_the_unpipelined_model(self):
        for case in CASES:
            stages = {}
            for r in self.results:
                stages.update(r[case["label"]]["weights"])
            want = self.ref[len(stages)][1]
            with self.subTest(case=case["label"]):
                self.assertEqual(sorted(stages), sorted(want))
                for k in want:
                    self.assertAlmostEqual(stages[k], want[k], delta=1e-5)

    def test_same_losses_as_pytorchs_own_classes(self):
        # PyTorch 2.6's Schedule1F1B and ScheduleZBVZeroBubble are left out: both fuse a send and a receive into
        # one batch_isend_irecv, and under gloo on CPU here 1F1B hung and ZBV failed ("writev: Bad file
        # descriptor"), while the same schedules from pipetrain run in PyTorch's _PipelineScheduleRuntime and
        # match the unpipelined model above.
        for name in ("gpipe",):
            with self.subTest(schedule=name):
                for a, b in zip(self.losses("pipetrain " + name), self.losses("torch " + name)):
                    self.assertAlmostEqual(a, b, delta=1e-9)


@unittest.skipUnless(HAVE_PIPELINING, WHY)
class Refusals(unittest.TestCase):
    def test_what_pytorch_cannot_run_is_refused_by_name(self):
        import pipetrain.torch as pt

        with self.assertRaisesRegex(ValueError, "steps"):
            pt.torch_actions(pipetrain.schedule("1f1b", stages=2, microbatches=2, steps=2))
        with self.assertRaisesRegex(ValueError, "flush"):
            pt.torch_actions(pipetrain.schedule("pipedream", stages=2, microbatches=2))
        with self.assertRaisesRegex(ValueError, "replicates"):
            pt.torch_actions(pipetrain.schedule("1f1b", replication=[2, 1], microbatches=2))

    def test_actions_in_pytorch_letters(self):
        import pipetrain.torch as pt

        acts = pt.torch_actions(pipetrain.schedule("zb-h1", stages=2, microbatches=2))
        # pipetrain's lowering: the receive of micro-batch 1 is posted before the backward of 0
        self.assertEqual([str(a) for a in acts[1]][:5], ["1RECV_F0", "1F0", "1RECV_F1", "1I0", "1SEND_B0"])
        self.assertEqual(len(acts[0]), len([a for a in pipetrain.lower(pipetrain.schedule(
            "zb-h1", stages=2, microbatches=2)).actions[0] if a.kind != "S"]))
        compute = pt.torch_actions(pipetrain.schedule("zb-h1", stages=2, microbatches=2), lower=False)
        self.assertEqual([str(a) for a in compute[0]], ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"])
        self.assertEqual(pt.stages_of(pipetrain.schedule("v-min", stages=2, microbatches=4), 0), [0, 3])


if __name__ == "__main__":
    support.main()

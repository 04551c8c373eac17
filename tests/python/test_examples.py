"""examples/python/ run and print what they promise (ctest Python.examples)."""

import os
import subprocess
import sys
import tempfile
import unittest

import support

EXAMPLES = os.path.join(support.SOURCE, "examples", "python")


def run(script, *args, timeout=240):
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"{script} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


class Examples(unittest.TestCase):
    def test_compare_schedules(self):
        with tempfile.TemporaryDirectory() as d:
            out = run("compare_schedules.py", "--stages", "4", "--microbatches", "8", "--out", d)
            for name in ("1f1b", "gpipe", "v-min", "zb-h1"):
                self.assertIn(name, out)
                self.assertTrue(os.path.getsize(os.path.join(d, name + ".svg")) > 1000, name)
            self.assertTrue(os.path.exists(os.path.join(d, "index.html")))

    def test_compare_schedules_refuses_a_bad_cost(self):
        r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "compare_schedules.py"), "--cost", "1:x:1",
                            "--out", os.devnull], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("error: cost 'x' in '1:x:1' is not a number", r.stderr)
        self.assertNotIn("fastest first", r.stdout)

    def test_plan_profile(self):
        with tempfile.TemporaryDirectory() as d:
            out = run("plan_profile.py", "--ranks", "4", "--out", os.path.join(d, "plan.json"))
            self.assertIn("PipeDream's planner", out)
            self.assertIn("umpipe dgap", out)
            self.assertTrue(os.path.exists(os.path.join(d, "plan.json")))

    def test_run_in_pytorch(self):
        try:
            from torch.distributed.pipelining import schedules
        except ImportError as e:
            self.skipTest(f"no torch.distributed.pipelining here ({e})")
        out = run("run_in_pytorch.py", "--schedule", "v-min", "--ranks", "2")
        pipelined = [l for l in out.splitlines() if "PyTorch's runtime" in l]
        reference = [l for l in out.splitlines() if "unpipelined" in l]
        self.assertEqual(len(pipelined), 5)
        self.assertEqual(len(reference), 5)
        for a, b in zip(pipelined, reference):
            self.assertAlmostEqual(float(a.split()[3]), float(b.split()[3]), delta=1e-5)


if __name__ == "__main__":
    support.main()

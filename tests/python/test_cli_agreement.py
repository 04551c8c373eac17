"""The Python module and the `pipetrain` command agree: the same cases through both, numbers compared.

The command needs LibTorch to build; where it is absent (a PIPETRAIN_CORE_ONLY build) these tests are
skipped with that reason (ctest shows them as skipped).
"""

import concurrent.futures
import json
import math
import os
import subprocess
import tempfile
import unittest

import pipetrain
import support

# (CLI flags, Python keyword arguments): the same case twice.
CASES = [
    (["-s", "gpipe", "-p", "4", "-m", "8"], dict(name="gpipe", stages=4, microbatches=8)),
    (["-s", "1f1b", "-p", "4", "-m", "8", "--cost", "1:2:1", "--comm", "0.25"],
     dict(name="1f1b", stages=4, microbatches=8, cost="1:2:1", comm=0.25)),
    (["-s", "interleaved", "-p", "2", "-m", "4", "-v", "2", "--cost", "2:2:2"],
     dict(name="interleaved", stages=2, microbatches=4, virtual=2, cost="2:2:2")),
    (["-s", "zb-h1", "-p", "4", "-m", "8", "--steps", "2"], dict(name="zb-h1", stages=4, microbatches=8, steps=2)),
    (["-s", "zb-auto", "-p", "4", "-m", "12", "--cost", "1:1.5:1,1:1:1,1:1:1,2:2:1", "--memory-limit", "5"],
     dict(name="zb-auto", stages=4, microbatches=12, cost="1:1.5:1,1:1:1,1:1:1,2:2:1", memory_limit=5)),
    (["-s", "zb-auto", "-p", "2", "-m", "3", "--memory-limit", "2", "--exact"],
     dict(name="zb-auto", stages=2, microbatches=3, memory_limit=2, exact=True)),
    (["-s", "v-half", "-p", "4", "-m", "8"], dict(name="v-half", stages=4, microbatches=8)),
    (["-s", "v-min", "-p", "4", "-m", "8", "--comm", "0.5"], dict(name="v-min", stages=4, microbatches=8, comm=0.5)),
    (["-s", "zb-v", "-p", "4", "-m", "8", "--reference"], dict(name="zb-v", stages=4, microbatches=8, reference=True)),
    (["-s", "dualpipev", "-p", "2", "-m", "4"], dict(name="dualpipev", stages=2, microbatches=4)),
    (["-s", "1f1b", "--replication", "2,1", "-m", "4"], dict(name="1f1b", replication=[2, 1], microbatches=4)),
    (["-s", "1f1b", "-p", "4", "-m", "4", "--skip", "0:3:0.5", "--skip-bandwidth", "0.25"],
     dict(name="1f1b", stages=4, microbatches=4, skips=["0:3:0.5"], skip_bandwidth=0.25)),
    (["-s", "2bw", "-p", "2", "-m", "4", "--steps", "3"], dict(name="2bw", stages=2, microbatches=4, steps=3)),
]

PROFILE = {
    "format": "pipetrain-profile", "version": 1, "model": "toy", "micro_batch_size": 4, "threads": 1,
    "source": "test",
    "layers": [{"name": f"l{i}", "type": "Linear", "forward_ms": 0.5 + i, "backward_ms": 1.0 + i,
                "activation_bytes": 4096.0 * (i + 1), "parameter_bytes": 1e6, "optimizer_bytes": 2e6}
               for i in range(6)],
}


def run_cli(*args):
    r = subprocess.run([support.PIPETRAIN_BIN, *args], capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


_cache = {}


def run_cli_all(commands):
    """Runs the commands 4 at a time (each start loads LibTorch, about a second) and caches their results."""
    todo = [tuple(c) for c in commands if tuple(c) not in _cache]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for c, r in zip(todo, pool.map(lambda c: run_cli(*c), todo)):
            _cache[c] = r
    return [_cache[tuple(c)] for c in commands]


def assert_same(test, a, b, path="$"):
    """Equal structure, numbers equal within 1e-9 relative (both sides print the same doubles)."""
    if isinstance(a, dict):
        test.assertEqual(sorted(a), sorted(b), path)
        for k in a:
            assert_same(test, a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        test.assertEqual(len(a), len(b), path)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(test, x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        test.assertTrue(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), f"{path}: {a} != {b}")
    else:
        test.assertEqual(a, b, path)


@unittest.skipUnless(os.access(support.PIPETRAIN_BIN, os.X_OK),
                     f"the pipetrain command ({support.PIPETRAIN_BIN}) is not built: it needs LibTorch "
                     "(this is a core-only build); build the target pipetrain to compare")
class CliAgreement(unittest.TestCase):
    def python_case(self, kw):
        kw = dict(kw)
        name = kw.pop("name")
        reference = kw.pop("reference", False)
        skip_bandwidth = kw.pop("skip_bandwidth", 0.0)
        s = pipetrain.schedule(name, **kw)
        cost_kw = {k: kw[k] for k in ("cost", "comm", "profile", "balance") if k in kw}
        return s, pipetrain.simulate(s, pipetrain.costs(s, skip_bandwidth=skip_bandwidth, **cost_kw),
                                     reference=reference)

    def test_simulate_json(self):
        results = run_cli_all([["simulate", *flags, "--json"] for flags, _ in CASES])
        for (flags, kw), (rc, out, err) in zip(CASES, results):
            with self.subTest(flags=" ".join(flags)):
                self.assertEqual(rc, 0, err)
                cli = json.loads(out)
                cli.pop("exact", None)  # the search's own report (the schedule it found is compared)
                _, sim = self.python_case(kw)
                assert_same(self, cli, sim.to_dict())

    def test_simulate_exact_json_by_name(self):
        # simulate(name, exact=True).to_dict() carries the search's 'exact' object, as --exact --json does.
        flags, kw = next(case for case in CASES if "--exact" in case[0])
        rc, out, err = run_cli("simulate", *flags, "--json")
        self.assertEqual(rc, 0, err)
        kw = dict(kw)
        cli = json.loads(out)
        self.assertIn("exact", cli)
        assert_same(self, cli, pipetrain.simulate(kw.pop("name"), **kw).to_dict())

    def test_simulate_table(self):
        flags, kw = CASES[1]
        rc, out, err = run_cli("simulate", *flags)
        self.assertEqual(rc, 0, err)
        self.assertEqual(out, self.python_case(kw)[1].table())

    def test_schedule_text_csv_torch_and_lowered(self):
        # (case, what to print): text and the lowered form of three cases, the CSV of one, PyTorch's CSV in
        # both letter sets of one with split backwards (each command start costs about a second).
        checks = [(i, extra) for i in (1, 2, 6) for extra in ([], ["--lower"])]
        checks += [(6, ["--format", "csv"])]
        checks += [(4, ["--format", "torch", "--letters", letters]) for letters in ("current", "legacy")]
        results = run_cli_all([["schedule", *CASES[i][0], *extra] for i, extra in checks])
        for (i, extra), (rc, out, err) in zip(checks, results):
            flags, kw = CASES[i]
            with self.subTest(flags=" ".join(flags + extra)):
                self.assertEqual(rc, 0, err)
                s, _ = self.python_case(kw)
                if not extra:
                    want = s.text()
                elif extra == ["--lower"]:
                    want = pipetrain.lower(s, pipetrain.costs(s, cost=kw.get("cost", "1:1:1"), comm=kw.get("comm", 0.0))).text()
                elif extra[1] == "csv":
                    want = s.to_csv()
                else:
                    want = pipetrain.to_torch_csv(s, letters=extra[3])
                self.assertEqual(out, want)

    def test_profile_costs(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "toy.json")
            with open(path, "w") as f:
                json.dump(PROFILE, f)
            balances = ("memory", "2,2,2")
            results = run_cli_all([["simulate", "-s", "1f1b", "-p", "3", "-m", "6", "--profile", path, "--balance", b,
                                    "--bandwidth", "2", "--latency", "30", "--json"] for b in balances])
            for balance, (rc, out, err) in zip(balances, results):
                with self.subTest(balance=balance):
                    self.assertEqual(rc, 0, err)
                    sim = pipetrain.simulate("1f1b", stages=3, microbatches=6, profile=PROFILE, balance=balance,
                                             bandwidth=2, latency=30)
                    assert_same(self, json.loads(out), sim.to_dict())

    def test_measured_transfers_with_one_flag(self):
        # A profile with measured transfers: a flag given replaces its own term only, in both.
        measured = dict(PROFILE, version=2, runtime={"transport": "shm", "latency_ms": 0.05,
                                                     "bandwidth_bytes_per_ms": 2000.0, "overhead_ms": 0.01})
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "measured.json")
            with open(path, "w") as f:
                json.dump(measured, f)
            cases = ((["--latency", "30"], {"latency": 30}), (["--bandwidth", "2"], {"bandwidth": 2}), ([], {}))
            results = run_cli_all([["simulate", "-s", "1f1b", "-p", "3", "-m", "6", "--profile", path, "--json", *flags]
                                   for flags, _ in cases])
            makespans = []
            for (flags, kw), (rc, out, err) in zip(cases, results):
                with self.subTest(flags=flags):
                    self.assertEqual(rc, 0, err)
                    sim = pipetrain.simulate("1f1b", stages=3, microbatches=6, profile=measured, **kw)
                    assert_same(self, json.loads(out), sim.to_dict())
                    makespans.append(json.loads(out)["makespan"])
            # 30 us against the measured 50 us, and 2 GB/s against the measured 2 MB/s: both are faster.
            self.assertLess(makespans[0], makespans[2])
            self.assertLess(makespans[1], makespans[2])

    def test_torch_csv_read_both_ways(self):
        path = os.path.join(support.DATA, "pytorch", "zb1p_2rank_2stagep_comms.csv")
        rc, out, err = run_cli("simulate", "--load", path, "--format", "torch", "--json")
        self.assertEqual(rc, 0, err)
        cli = json.loads(out)
        r = pipetrain.load_torch_csv(path)
        pipetrain.validate(r.schedule)
        d = pipetrain.simulate(r.schedule, pipetrain.costs(r.schedule)).to_dict()
        d["notes"] = cli["notes"]  # the command's own lines about how it read the file
        assert_same(self, cli, d)

    def test_same_error_message(self):
        rc, _, err = run_cli("simulate", "-s", "interleaved", "-p", "4", "-m", "6", "-v", "2")
        self.assertEqual(rc, 2)
        with self.assertRaises(ValueError) as e:
            pipetrain.schedule("interleaved", stages=4, microbatches=6, virtual=2)
        self.assertIn(str(e.exception), err)


if __name__ == "__main__":
    support.main()

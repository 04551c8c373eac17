"""The Python module over pipetrain's torch-free layers: plain unittest (ctest Python.module).

Run from a build tree: PYTHONPATH=build/python python3 -m unittest -v tests/python/test_module.py
"""

import json
import os
import tempfile
import unittest

import pipetrain
import support

SOURCE = os.environ.get("PIPETRAIN_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
DATA = os.path.join(SOURCE, "data")


def small_profile(layers=6):
    """A profile dict in docs/PROFILE.md's JSON form, uneven on purpose."""
    return {
        "format": "pipetrain-profile",
        "version": 1,
        "model": "toy",
        "micro_batch_size": 4,
        "threads": 1,
        "source": "test",
        "layers": [
            {"name": f"l{i}", "type": "Linear", "forward_ms": 1.0 + i, "backward_ms": 2.0 + 2 * i,
             "activation_bytes": 1000.0 * (i + 1), "parameter_bytes": 4000.0, "optimizer_bytes": 8000.0}
            for i in range(layers)
        ],
    }


class Schedules(unittest.TestCase):
    def test_every_generator_builds_and_validates(self):
        names = pipetrain.schedule_names()
        for n in ("gpipe", "1f1b", "zb-h1", "zb-auto", "v-half", "v-min", "zb-v", "interleaved"):
            self.assertIn(n, names)
        for name in names:
            traits = pipetrain.schedule_traits(name)
            v = 2 if traits["virtual_stages"] else 1
            s = pipetrain.schedule(name, stages=4, microbatches=8, virtual=v)
            self.assertEqual(s.ranks, 4, name)
            pipetrain.validate(s)  # generated schedules are valid
            computes = sum(1 for row in s.actions for a in row if a.kind == "F")
            self.assertEqual(computes, s.stages * s.microbatches, name)

    def test_actions_as_objects_and_text(self):
        s = pipetrain.schedule("1f1b", stages=2, microbatches=2)
        self.assertEqual(s.rank_line(0), "0F0 0F1 0BW0 0BW1 0S0")
        self.assertEqual(str(s.actions[1][0]), "1F0")
        a = s.actions[0][2]
        self.assertEqual((a.kind, a.stage, a.index), ("BW", 0, 0))
        self.assertEqual(pipetrain.Action.parse("0BW0"), a)
        self.assertEqual(pipetrain.Action("BW", 0, 0), a)
        self.assertEqual(s.text(), "rank 0: 0F0 0F1 0BW0 0BW1 0S0\nrank 1: 1F0 1BW0 1F1 1BW1 1S0\n")
        self.assertEqual(pipetrain.Schedule.from_csv(s.to_csv()), s)
        self.assertEqual(len({a for row in s.actions for a in row}), 10)  # hashable, all distinct

    def test_lowering_and_strip(self):
        s = pipetrain.schedule("1f1b", stages=2, microbatches=2)
        low = pipetrain.lower(s)
        self.assertEqual(low.rank_line(0), "0F0 0SF0 0F1 0SF1 0RB0 0BW0 0RB1 0BW1 0S0")
        pipetrain.validate(low)
        self.assertEqual(pipetrain.strip_communication(low), s)

    def test_bad_values_are_value_errors_with_the_cli_message(self):
        with self.assertRaisesRegex(ValueError, "no-such"):
            pipetrain.schedule("no-such", stages=2, microbatches=2)
        with self.assertRaises(ValueError) as e:
            pipetrain.schedule("1f1b", stages=0, microbatches=2)
        self.assertIn("0", str(e.exception))
        with self.assertRaisesRegex(ValueError, "cost"):
            pipetrain.simulate("1f1b", stages=2, microbatches=2, cost="1:1")

    def test_validation_error_carries_the_grid(self):
        s = pipetrain.schedule("1f1b", stages=2, microbatches=2)
        rows = s.actions
        rows[0] = [rows[0][2]] + rows[0][:2] + rows[0][3:]  # a backward before its forward
        s.actions = rows
        with self.assertRaises(pipetrain.ScheduleError) as e:
            pipetrain.validate(s)
        self.assertIsInstance(e.exception, ValueError)
        text = str(e.exception)
        self.assertIn("[", text)  # the marked cell
        self.assertIn("0BW0", text)
        self.assertIn("rank 1", text.lower().replace("r1", "rank 1"))

    def test_memory_limit_is_checked(self):
        with self.assertRaises(pipetrain.ScheduleError):
            pipetrain.schedule("gpipe", stages=2, microbatches=8, memory_limit=3)

    def test_exact_search(self):
        r = pipetrain.zb_exact(2, 3, memory_limit=2)
        self.assertTrue(r.proven)
        self.assertLessEqual(r.makespan, r.greedy_makespan)
        s = pipetrain.schedule("zb-auto", stages=2, microbatches=3, memory_limit=2, exact=True)
        self.assertAlmostEqual(pipetrain.simulate(s).makespan, r.makespan)


class Simulation(unittest.TestCase):
    def test_gpipe_closed_form(self):
        # makespan (m + p - 1)(F + B + W); bubble fraction (p - 1) / (m + p - 1)
        p, m = 4, 8
        sim = pipetrain.simulate("gpipe", stages=p, microbatches=m)
        self.assertAlmostEqual(sim.makespan, (m + p - 1) * 3)
        self.assertAlmostEqual(sim.bubble_fraction, (p - 1) / (m + p - 1))
        self.assertEqual([r.peak_inflight for r in sim.per_stage], [m] * p)
        self.assertAlmostEqual(sim.peak_memory, m)
        for r in sim.per_stage:
            self.assertAlmostEqual(r.busy, m * 3)
            self.assertAlmostEqual(r.bubble, r.span - r.busy)

    def test_v_min_uses_less_memory_than_1f1b(self):
        p, m = 4, 8
        one = pipetrain.simulate("1f1b", stages=p, microbatches=m)
        vmin = pipetrain.simulate("v-min", stages=p, microbatches=m)
        self.assertAlmostEqual(one.peak_memory, p)
        self.assertAlmostEqual(vmin.peak_memory, (p + 4) // 3)
        self.assertLess(vmin.peak_memory, one.peak_memory)

    def test_both_bubble_definitions(self):
        sim = pipetrain.simulate("zb-h1", stages=4, microbatches=8)
        busy = sum(r.busy for r in sim.per_stage)
        self.assertAlmostEqual(sim.bubble_fraction, 1 - busy / (4 * sim.makespan))
        self.assertAlmostEqual(sim.max_bubble, max(r.span - r.busy for r in sim.per_stage))
        self.assertAlmostEqual(sim.max_bubble_fraction, sim.max_bubble / sim.makespan)
        # ZB-H1's idle per rank is (p-1)(F+B-W) = 3 with unit costs
        self.assertAlmostEqual(sim.max_bubble, 3.0)

    def test_timeline_records_and_writers(self):
        sim = pipetrain.simulate("1f1b", stages=2, microbatches=2, cost="1:2:0", comm=0.5)
        records = sim.timeline.records()
        self.assertEqual(len(records), len(sim.timeline))
        first = min(records, key=lambda r: (r["start"], r["rank"]))
        self.assertEqual((first["action"], first["start"], first["end"]), ("0F0", 0.0, 1.0))
        last = max(r["end"] for r in records)
        self.assertAlmostEqual(last, sim.makespan)
        svg = sim.svg()
        self.assertTrue(svg.lstrip().startswith("<svg") or svg.lstrip().startswith("<?xml"))
        trace = json.loads(sim.chrome_trace())
        self.assertIn("traceEvents", trace)
        with tempfile.TemporaryDirectory() as d:
            sim.write_svg(os.path.join(d, "t.svg"))
            sim.write_trace(os.path.join(d, "t.json"))
            with open(os.path.join(d, "t.svg")) as f:
                self.assertEqual(f.read(), svg)
            with self.assertRaises(ValueError):  # a folder that does not exist: refused, named
                sim.write_svg(os.path.join(d, "nope", "t.svg"))
        self.assertIn("makespan", sim.table())
        self.assertEqual(len(sim.ascii().splitlines()), 2)

    def test_heap_table(self):
        s = pipetrain.schedule("1f1b", stages=2, microbatches=4)
        c = pipetrain.CostModel([pipetrain.StageCost(activation=2.0, gradient_b=5.0, message=1.0)] * 2)
        heap = pipetrain.predict_heap(s, c)
        self.assertEqual(len(heap), 2)
        for h in heap:
            self.assertAlmostEqual(h.total, h.activations + h.gradients + h.transfers)
            self.assertAlmostEqual(h.gradients, 5.0)
        self.assertAlmostEqual(heap[0].activations, 2 * 2.0)  # rank 0 holds 2 micro-batches in 1F1B, p = 2
        ref = pipetrain.predict_heap(s, c, reference=True)
        self.assertLessEqual(ref[0].transfers, heap[0].transfers)
        d = pipetrain.simulate(s, c).to_dict()
        self.assertAlmostEqual(d["per_stage"][0]["heap"]["total"], heap[0].total)

    def test_cost_per_rank_splits_over_chunks(self):
        s = pipetrain.schedule("interleaved", stages=2, microbatches=4, virtual=2)
        c = pipetrain.costs(s, cost="2:2:2,4:4:4")
        self.assertEqual(len(c.stage), 4)
        self.assertAlmostEqual(c.stage[1].f, 2.0)  # stage 1 is on rank 1: 4 / 2 chunks
        self.assertAlmostEqual(c.stage[2].f, 1.0)


class TorchCsv(unittest.TestCase):
    def test_both_forms_both_letter_sets(self):
        s = pipetrain.schedule("zb-h1", stages=2, microbatches=2)
        for letters in ("current", "legacy"):
            text = pipetrain.to_torch_csv(s, letters=letters)
            back = pipetrain.from_torch_csv(text)
            self.assertEqual(back.letters, letters)
            self.assertFalse(back.with_communication)
            pipetrain.validate(back.schedule)
            self.assertEqual(pipetrain.strip_communication(back.schedule).actions, s.actions)
        low = pipetrain.to_torch_csv(pipetrain.lower(s))
        self.assertIn("SEND_F", low)
        back = pipetrain.from_torch_csv(low)
        self.assertTrue(back.with_communication)
        self.assertEqual(pipetrain.strip_communication(back.schedule).actions, s.actions)

    def test_pytorch_dumps_in_data(self):
        for name in ("zb1p_2rank_2stagep_compute.csv", "zb1p_2rank_2stagep_comms_legacy.csv"):
            r = pipetrain.load_torch_csv(os.path.join(DATA, "pytorch", name))
            pipetrain.validate(r.schedule)
            self.assertEqual(r.schedule.ranks, 2)
        with self.assertRaisesRegex(ValueError, "letter set .modern."):
            pipetrain.from_torch_csv("0F0\n", letters="modern")

    def test_async_schedule_has_no_pytorch_form(self):
        with self.assertRaises(ValueError):
            pipetrain.to_torch_csv(pipetrain.schedule("pipedream", stages=2, microbatches=2))


class Planning(unittest.TestCase):
    def test_profile_in_dict_out(self):
        prof = pipetrain.profile(small_profile())
        self.assertEqual(len(prof["layers"]), 6)
        self.assertEqual(prof["layers"][2]["forward_ms"], 3.0)
        self.assertEqual(pipetrain.profile(json.dumps(small_profile()))["model"], "toy")
        bad = small_profile()
        bad["layers"][1]["foward_ms"] = 1.0
        with self.assertRaisesRegex(ValueError, r"layers\[1\]"):
            pipetrain.profile(bad)

    def test_balances(self):
        prof = small_profile()
        b = pipetrain.balance(prof, 2, kind="time")
        self.assertEqual(sum(b), 6)
        costs = pipetrain.balance_costs(prof, "time")
        self.assertEqual(b, pipetrain.balance_min_max(costs, 2))
        self.assertLessEqual(pipetrain.bottleneck(costs, b), pipetrain.bottleneck(costs, [3, 3]))
        self.assertEqual(pipetrain.balance(prof, 3, kind="uniform"), [2, 2, 2])
        self.assertEqual(pipetrain.balance(prof, 2, kind="2,4"), [2, 4])
        with self.assertRaisesRegex(ValueError, "7"):
            pipetrain.balance(prof, 7)
        c = pipetrain.stage_costs(prof, [3, 3])
        self.assertAlmostEqual(c.stage[0].f, 1 + 2 + 3)

    def test_simulate_with_a_profile(self):
        sim = pipetrain.simulate("1f1b", stages=2, microbatches=4, profile=small_profile(), balance="3,3")
        self.assertAlmostEqual(sim.per_stage[0].busy, 4 * ((1 + 2 + 3) + (2 + 4 + 6)))

    def test_pipedream_planner_on_vgg16(self):
        path = os.path.join(DATA, "pipedream", "vgg16-graph.txt")
        plan = pipetrain.plan_pipedream(path, ranks=4, bandwidth=1.25)
        self.assertEqual(plan["format"], "pipetrain-plan")
        self.assertEqual(sum(plan["replication"]), 4)
        self.assertEqual(plan["replication"], [3, 1])  # PipeDream's own answer for VGG-16 on 4 GPUs
        self.assertGreater(plan["speedup_over_data_parallel"], 1.0)

    def test_search_plans_and_umpipe(self):
        prof = small_profile()
        res = pipetrain.search_plans(prof, ranks=2, microbatch_counts=[1, 2, 4], schedules=["gpipe", "1f1b"])
        self.assertEqual(res["batch_size"], 32)
        best = res["best_straight"]
        self.assertEqual(best["stages"], 2)  # one stage per rank
        self.assertTrue(all(best["makespan"] <= c["makespan"] for c in res["candidates"]
                            if c["fits"] and c["stages"] == 2 and c["replicas"] == 1))
        chosen = res["chosen"]  # hybrid plans: stages x replicas, never slower than any candidate printed
        self.assertLessEqual(chosen["stages"] * chosen["replicas"], 2)
        self.assertTrue(all(chosen["makespan"] <= c["makespan"] + 1e-9 for c in res["candidates"] if c["fits"]))
        straight = pipetrain.search_plans(prof, ranks=2, microbatch_counts=[1, 2, 4], schedules=["gpipe", "1f1b"],
                                          hybrid=False)
        self.assertTrue(all(c["stages"] == 2 and c["replicas"] == 1 for c in straight["candidates"]))
        self.assertEqual(res["plan_file"]["format"], "pipetrain-plan")
        # PipeDream's plan for ranks / d ranks x d copies: its replication times d, never better than chosen.
        vgg = pipetrain.search_plans(os.path.join(DATA, "pipedream", "vgg16-graph.txt"), ranks=8, bandwidth=1.25)
        self.assertTrue(vgg["pipedream_copies"])
        for c in vgg["pipedream_copies"]:
            self.assertGreater(c["copies"], 1)
            self.assertEqual(c["replication"], [r * c["copies"] for r in c["plan"]["replication"]])
            self.assertLessEqual(vgg["chosen"]["makespan"], c["makespan"] + 1e-9)
        um = pipetrain.umpipe(prof, balance=best["balance"], samples=8, generations=20)
        self.assertEqual([u["planner"] for u in um], ["equal", "local-greedy", "global-dp", "dgap"])
        for u in um:
            self.assertTrue(all(sum(row) == 8 for row in u["forward"] + u["backward"]))
        self.assertLessEqual(um[-1]["step_ms"], um[0]["step_ms"] + 1e-9)


class Help(unittest.TestCase):
    def test_docstrings(self):
        for f in (pipetrain.schedule, pipetrain.simulate, pipetrain.validate, pipetrain.lower, pipetrain.search_plans,
                  pipetrain.plan_pipedream, pipetrain.umpipe, pipetrain.to_torch_csv, pipetrain.from_torch_csv):
            self.assertTrue(f.__doc__ and len(f.__doc__) > 40, f.__name__)

    def test_stub_lists_the_public_names(self):
        stub = os.path.join(os.path.dirname(pipetrain.__file__), "__init__.pyi")
        with open(stub) as f:
            text = f.read()
        for name in pipetrain.__all__:
            obj = getattr(pipetrain, name)
            if isinstance(obj, type):
                self.assertTrue(f"class {name}" in text, name)
            elif callable(obj) and obj is not pipetrain.generate:
                self.assertTrue(f"def {name}(" in text, name)


if __name__ == "__main__":
    support.main()

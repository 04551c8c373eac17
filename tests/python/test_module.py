"""The Python module over pipetrain's torch-free layers: plain unittest (ctest Python.module).

Run from a build tree: PYTHONPATH=build/python python3 -m unittest -v tests/python/test_module.py
"""

import copy
import json
import os
import pathlib
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import warnings

import pipetrain
import pipetrain.torch  # imports without torch; only its runners need it
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

    def test_list_fields_are_copies(self):
        # Their elements pointed into the C++ vectors: writing one changed the schedule behind its
        # documented copy, and after the list was assigned they read freed memory.
        s = pipetrain.schedule("1f1b", stages=2, microbatches=4)
        line = s.rank_line(0)
        a = s.actions[0][0]
        a.stage = 1
        self.assertEqual(s.rank_line(0), line)
        s.actions = [[pipetrain.Action("F", 0, 9)], [pipetrain.Action("F", 1, 9)]]
        self.assertEqual(str(a), "1F0")  # still the copy it was
        a.index = 7
        self.assertEqual(s.rank_line(0), "0F9")
        c = pipetrain.CostModel.uniform(2, pipetrain.StageCost())
        st = c.stage[0]
        c.stage = []
        st.f = 3.0
        self.assertEqual(st.f, 3.0)
        self.assertEqual(len(c.stage), 0)
        sim = pipetrain.simulate(pipetrain.schedule("1f1b", stages=2, microbatches=2))
        rm = sim.metrics.per_rank[0]
        ev = sim.timeline.events[0]
        del sim
        self.assertEqual(rm.rank, 0)
        self.assertEqual(ev.rank, ev.action.stage)

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

    def test_what_the_command_line_refuses_is_refused_here_too(self):
        # A looped schedule without virtual stages is the unlooped one under its name; comm with a profile
        # was ignored (its transfers are priced from bandwidth and latency).
        with self.assertRaisesRegex(ValueError, "give virtual 2 or more, or ask for 1f1b"):
            pipetrain.schedule("interleaved", stages=2, microbatches=4)
        self.assertEqual(pipetrain.schedule("interleaved", stages=2, microbatches=4, virtual=2).ranks, 2)
        with self.assertRaisesRegex(ValueError, "comm was ignored"):
            pipetrain.simulate("1f1b", stages=2, microbatches=4, profile=small_profile(), balance="3,3", comm=5)

    def test_stage_costs_price_each_cut_by_its_own_bytes(self):
        # VGG-16's cuts carry very different activations: each boundary gets its own transfer time, the
        # largest is `comm`, and a CostModel built with them simulates the same as the one stage_costs gave.
        path = os.path.join(DATA, "pipedream", "vgg16-graph.txt")
        c = pipetrain.stage_costs(path, [3, 9, 12, 15], bandwidth=1.25, latency=0)
        self.assertEqual(len(c.boundary_comm), 3)
        self.assertAlmostEqual(max(c.boundary_comm), c.comm)
        self.assertGreater(max(c.boundary_comm), 2 * min(c.boundary_comm))
        same = pipetrain.CostModel(stage=c.stage, comm=c.comm, boundary_comm=c.boundary_comm)
        flat = pipetrain.CostModel(stage=c.stage, comm=c.comm)
        s = pipetrain.schedule("1f1b", stages=4, microbatches=8)
        self.assertAlmostEqual(pipetrain.simulate(s, costs=same).makespan, pipetrain.simulate(s, costs=c).makespan)
        self.assertLess(pipetrain.simulate(s, costs=same).makespan, pipetrain.simulate(s, costs=flat).makespan)

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



def vgg16():
    with open(os.path.join(DATA, "pipedream", "vgg16-graph.txt")) as f:
        return pipetrain.parse_pipedream_graph(f.read(), micro_batch_size=128)


def run_python(code):
    """Runs code in a fresh interpreter (a crash must fail one test, not kill the suite): (returncode, output)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    return r.returncode, r.stdout + r.stderr


class MalformedSchedules(unittest.TestCase):
    """Every binding that takes a Schedule validates it first, as the command line does with --load."""

    def test_an_incomplete_schedule_is_refused(self):
        s = pipetrain.Schedule.from_csv("0F0,0BW0,0F1\n1F0,1BW0,1F1,1BW1\n")  # rank 0 never runs 0BW1
        for f in (pipetrain.simulate, pipetrain.lower, pipetrain.predict_heap, pipetrain.to_torch_csv,
                  pipetrain.costs, pipetrain.strip_communication):
            with self.subTest(f=f.__name__), self.assertRaisesRegex(pipetrain.ScheduleError, "0BW1"):
                f(s)
        # pipetrain.torch's check (no torch needed): torch_actions(lower=False) handed it to PyTorch unchecked
        with self.assertRaisesRegex(pipetrain.ScheduleError, "0BW1"):
            pipetrain.torch.check_runnable(s)
        dup = pipetrain.Schedule.from_csv("0F0,0F0,0BW0\n1F0,1BW0\n")
        with self.assertRaises(pipetrain.ScheduleError):
            pipetrain.simulate(dup)

    def test_malformed_schedules_raise_instead_of_crashing(self):
        setup = ("import pipetrain as P\n"
                 "def show(f):\n"
                 "    try: f(); print('NO ERROR')\n"
                 "    except (ValueError, IndexError) as e: print(type(e).__name__, str(e).splitlines()[0])\n")
        replica = ('P.Schedule.from_csv("# pipetrain schedule name=x ranks=2 stages=2 microbatches=2 '
                   'microbatches_per_step=2 synchronous=1 stage_rank=0:1 stage_replicas=0/9:1\\n'
                   '0F0,0F1,0BW0,0BW1,0S0\\n1F0,1BW0,1F1,1BW1,1S0\\n")')
        cases = {
            "simulate(Schedule())": ("show(lambda: P.simulate(P.Schedule()))", "action rows"),
            "lower(Schedule())": ("show(lambda: P.lower(P.Schedule()))", "action rows"),
            "predict_heap(Schedule())": ("show(lambda: P.predict_heap(P.Schedule()))", "action rows"),
            "render_grid(Schedule())": ("show(lambda: P.render_grid(P.Schedule(), [(0, 0)]))", "marked cell (0, 0)"),
            "render_grid ranks=12": ("s = P.schedule('1f1b', stages=2, microbatches=2); s.ranks = 12\n"
                                     "print(P.render_grid(s).count('\\nrank ')); show(lambda: P.render_grid(s, [(5, 0)]))",
                                     "2\n"),
            "index -1": ("s = P.schedule('1f1b', stages=1, microbatches=1)\n"
                         "rows = s.actions; rows[0][0].index = -1; rows[0][1].index = -1; s.actions = rows\n"
                         "show(lambda: P.simulate(s))", "micro-batch -1"),
            "Action index -1": ("show(lambda: P.Action('F', 0, -1))", "index=-1"),
            "ranks=3 to_csv": ("s = P.schedule('1f1b', stages=2, microbatches=2); s.ranks = 3\n"
                               "show(s.to_csv); show(lambda: str(s)); show(s.text)", "ranks is 3 but actions has 2 rows"),
            # (from_csv itself may refuse it: the CSV's header is checked where it is read)
            "replica on rank 9": (f"show(lambda: P.simulate({replica})); show(lambda: P.lower({replica}))",
                                  "replica on rank 9"),
        }
        for name, (code, expected) in cases.items():
            with self.subTest(case=name):
                rc, out = run_python(setup + code)
                self.assertEqual(rc, 0, out)
                self.assertNotIn("NO ERROR", out)
                self.assertIn(expected, out)

    def test_render_grid_marks_only_existing_cells(self):
        s = pipetrain.schedule("1f1b", stages=2, microbatches=2)
        self.assertIn("[0F0]", pipetrain.render_grid(s, [(0, 0)]))
        with self.assertRaisesRegex(ValueError, r"marked cell \(2, 0\)"):
            pipetrain.render_grid(s, [(2, 0)])
        s.ranks = 3  # inconsistent: the grid shows the rows there are
        self.assertEqual(pipetrain.render_grid(s, [(1, 1)]).count("\nrank "), 2)
        self.assertIn("[1BW0]", pipetrain.render_grid(s, [(1, 1)]))

    def test_an_incomplete_schedule_still_prints(self):
        s = pipetrain.Schedule.from_csv("0F0,0BW0,0F1\n1F0,1BW0,1F1,1BW1\n")
        self.assertEqual(s.rank_line(0), "0F0 0BW0 0F1")
        self.assertEqual(pipetrain.Schedule.from_csv(s.to_csv()), s)

    def test_validate_cost_is_small(self):
        # Not a timing: the validation simulate() adds is one pass (schedule() validated already).
        s = pipetrain.schedule("1f1b", stages=4, microbatches=8)
        self.assertEqual(pipetrain.simulate(s).makespan, pipetrain.simulate("1f1b", stages=4, microbatches=8).makespan)


class SimulateAScheduleObject(unittest.TestCase):
    """simulate(Schedule, ...) as `pipetrain simulate --load FILE ...`."""

    def test_memory_limit_is_checked(self):
        s = pipetrain.schedule("gpipe", stages=4, microbatches=8)
        with self.assertRaisesRegex(pipetrain.ScheduleError, "above the memory limit 2"):
            pipetrain.simulate(s, memory_limit=2)
        self.assertEqual(pipetrain.simulate(s, memory_limit=8).peak_memory, 8)

    def test_skips_apply_to_a_copy(self):
        s = pipetrain.schedule("gpipe", stages=4, microbatches=8)
        sim = pipetrain.simulate(s, skips=["0:3:5"], comm=1)
        # pipetrain simulate --load gpipe.csv --skip 0:3:5 --comm 1: rank 3 peaks at 8 + 8 x 5 = 48
        self.assertEqual(sim.per_stage[3].peak_memory, 48.0)
        self.assertEqual(len(sim.schedule.skips), 1)
        self.assertEqual(s.skips, [])  # the caller's schedule is untouched
        by_name = pipetrain.simulate("gpipe", stages=4, microbatches=8, skips=["0:3:5"], comm=1)
        self.assertEqual(by_name.per_stage[3].peak_memory, 48.0)

    def test_generation_keywords_are_refused_unless_they_agree(self):
        s = pipetrain.schedule("gpipe", stages=4, microbatches=8)
        for kw in (dict(stages=3), dict(microbatches=4), dict(virtual=2), dict(steps=2), dict(exact=True),
                   dict(exact_nodes=10), dict(replication=[1, 1, 1, 1])):
            with self.subTest(kw=kw), self.assertRaisesRegex(TypeError, list(kw)[0]):
                pipetrain.simulate(s, **kw)
        same = pipetrain.simulate(s, stages=4, microbatches=8, virtual=1, steps=1)
        self.assertEqual(same.makespan, pipetrain.simulate(s).makespan)

    def test_not_a_schedule(self):
        with self.assertRaisesRegex(TypeError, "schedule must be a Schedule or a schedule name.*int"):
            pipetrain.simulate(5)
        with self.assertRaisesRegex(TypeError, "costs must be a CostModel"):
            pipetrain.simulate("1f1b", "1:1:1", stages=2, microbatches=2)


class Compare(unittest.TestCase):
    def test_bad_arguments_raise(self):
        for kw, pattern in ((dict(cost="1:x:1"), "'x'"), (dict(comm=-1), "comm=-1"),
                            (dict(comm=float("nan")), "comm=nan"),
                            (dict(stages=4, microbatches=8, cost="1:1:1,2:2:2"), "2 F:B:W triples"),
                            (dict(virtual=0), "virtual=0"), (dict(stages=0), "stages=0")):
            with self.subTest(kw=kw), self.assertRaisesRegex(ValueError, pattern):
                pipetrain.compare(**kw)

    def test_a_schedule_that_cannot_be_built_is_named_in_a_warning(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = pipetrain.compare(stages=4, microbatches=6)
        names = {r["name"] for r in rows}
        self.assertNotIn("interleaved", names)
        self.assertIn("1f1b", names)
        text = " ".join(str(w.message) for w in caught)
        self.assertIn("interleaved left out", text)
        self.assertIn("multiple of the stages", text)
        with self.assertRaises(ValueError):  # named: raises
            pipetrain.compare(["interleaved"], stages=4, microbatches=6)


class PlannerArguments(unittest.TestCase):
    def test_levels_must_describe_the_ranks(self):
        prof = vgg16()
        with self.assertRaisesRegex(ValueError, r"4 x 4 = 16 devices but ranks is 4: give ranks=16"):
            pipetrain.plan_pipedream(prof, ranks=4, levels=["4:10", "4:1"])
        with self.assertRaisesRegex(ValueError, r"16 devices but ranks is 4"):
            pipetrain.search_plans(prof, ranks=4, levels=["4:10", "4:1"])
        plan = pipetrain.plan_pipedream(prof, levels=["4:10", "4:1"])  # ranks left out: the product
        self.assertLessEqual(sum(plan["replication"]), 16)
        self.assertEqual(plan, pipetrain.plan_pipedream(prof, ranks=16, levels=["4:10", "4:1"]))

    def test_levels_are_whole_machines_in_a_list(self):
        prof = vgg16()
        for levels in ([(4.5, 10.0)], ["4.5:10"], ["4:x"], [(0, 10.0)], [(4, float("nan"))]):
            with self.subTest(levels=levels), self.assertRaisesRegex(ValueError, r"levels\[0\]"):
                pipetrain.plan_pipedream(prof, ranks=4, levels=levels)
        with self.assertRaisesRegex(TypeError, "levels must be a list"):
            pipetrain.search_plans(prof, ranks=4, levels="4:10")
        self.assertEqual(pipetrain.plan_pipedream(prof, levels=[(4, 10)]),
                         pipetrain.plan_pipedream(prof, ranks=4, levels=["4:10"]))

    def test_out_of_range_numbers(self):
        prof = vgg16()
        with self.assertRaisesRegex(ValueError, "batch_size=-5"):
            pipetrain.search_plans(prof, ranks=2, batch_size=-5)
        for f in (pipetrain.search_plans, pipetrain.plan_pipedream):
            with self.subTest(f=f.__name__), self.assertRaisesRegex(ValueError, "activation_compression=-1"):
                f(prof, ranks=2, activation_compression=-1)
        with self.assertRaisesRegex(ValueError, "latency=nan"):
            pipetrain.search_plans(prof, ranks=2, latency=float("nan"))


class NonFiniteNumbers(unittest.TestCase):
    def test_nan_and_inf_are_refused_by_keyword(self):
        path = os.path.join(DATA, "pipedream", "vgg16-graph.txt")
        kw = dict(stages=2, microbatches=4, profile=path)
        nan, inf = float("nan"), float("inf")
        cases = [
            (lambda: pipetrain.simulate("1f1b", bandwidth=nan, **kw), "bandwidth=nan"),
            (lambda: pipetrain.simulate("1f1b", latency=-1.0, **kw), "latency=-1"),
            (lambda: pipetrain.simulate("1f1b", microbatch_size=nan, **kw), "microbatch_size=nan"),
            (lambda: pipetrain.schedule("zb-auto", stages=4, microbatches=8, memory_limit=nan), "memory_limit=nan"),
            (lambda: pipetrain.schedule("1f1b", stages=4, microbatches=8, memory_limit=inf), "memory_limit=inf"),
            (lambda: pipetrain.validate(pipetrain.schedule("1f1b", stages=2, microbatches=2), memory_limit=nan),
             "memory_limit=nan"),
            (lambda: pipetrain.simulate("1f1b", stages=2, microbatches=2, comm=nan), "comm=nan"),
            (lambda: pipetrain.stage_costs(path, [20, 19], microbatch_size=nan), "microbatch_size=nan"),
            (lambda: pipetrain.stage_costs(path, [20, 19], bandwidth=nan), "bandwidth=nan"),
            (lambda: pipetrain.zb_exact(2, 3, memory_limit=nan), "memory_limit=nan"),
        ]
        for f, pattern in cases:
            with self.subTest(pattern=pattern), self.assertRaisesRegex(ValueError, pattern):
                f()

    def test_a_profile_dict_with_nan_names_the_field(self):
        d = small_profile()
        d["layers"][2]["forward_ms"] = float("nan")
        with self.assertRaisesRegex(ValueError, r"layers\[2\]\.forward_ms is nan"):
            pipetrain.profile(d)


class Pickling(unittest.TestCase):
    def round_trip(self, obj):
        return pickle.loads(pickle.dumps(obj)), copy.deepcopy(obj)

    def test_value_types(self):
        s = pipetrain.schedule("1f1b", stages=4, microbatches=8, skips=["0:3:0.5"])
        for back in self.round_trip(s):
            self.assertEqual(back, s)
            self.assertEqual(back.to_csv(), s.to_csv())
        low = pipetrain.lower(pipetrain.schedule("zb-v", stages=2, microbatches=4))
        self.assertEqual(pickle.loads(pickle.dumps(low)), low)  # transfers, pairs, V stages
        rr = pipetrain.schedule("1f1b", replication=[2, 1], microbatches=4)
        self.assertEqual(pickle.loads(pickle.dumps(rr)).stage_replicas, rr.stage_replicas)
        a = pipetrain.Action("SF", 0, 3, paired=True, peer=2)
        for back in self.round_trip(a):
            self.assertEqual((back.kind, back.stage, back.index, back.paired, back.peer), ("SF", 0, 3, True, 2))
        self.assertEqual(copy.deepcopy(s.actions), s.actions)
        c = pipetrain.StageCost(1, 2, 3, 4, 5, 6, 7)
        c.w_held = 0.25
        for back in self.round_trip(c):
            self.assertEqual([back.f, back.b, back.w, back.activation, back.gradient_b, back.gradient_w, back.message,
                              back.w_held], [1, 2, 3, 4, 5, 6, 7, 0.25])
        m = pipetrain.CostModel([c, pipetrain.StageCost()], comm=0.5, step=2, bandwidth=3, stage_step=[1, 2],
                                b_release_fraction=0.25, overhead=0.1)
        for back in self.round_trip(m):
            self.assertEqual(len(back.stage), 2)
            self.assertEqual(back.stage[0].w_held, 0.25)
            self.assertEqual((back.comm, back.step, back.bandwidth, back.stage_step, back.b_release_fraction,
                              back.overhead), (0.5, 2, 3, [1, 2], 0.25, 0.1))
        k = pipetrain.SkipEdge(0, 3, 0.5)
        self.assertEqual(pickle.loads(pickle.dumps(k)), k)
        timeline = pipetrain.simulate("1f1b", stages=2, microbatches=2, comm=0.5).timeline
        for back in self.round_trip(timeline):
            self.assertEqual(back.records(), timeline.records())
            self.assertEqual((back.schedule, back.ranks, back.microbatches, back.unit),
                             (timeline.schedule, timeline.ranks, timeline.microbatches, timeline.unit))
            self.assertEqual(pipetrain.chrome_trace_json(back), pipetrain.chrome_trace_json(timeline))

    def test_simulation_and_exact_result(self):
        sim = pipetrain.simulate("zb-auto", stages=2, microbatches=3, memory_limit=2, exact=True, comm=0.5,
                                 reference=True)
        for back in self.round_trip(sim):
            self.assertEqual(back.to_dict(), sim.to_dict())
            self.assertEqual(back.heap_policy, sim.heap_policy)
            self.assertEqual(back.exact.summary(), sim.exact.summary())


class ExactSummary(unittest.TestCase):
    def test_to_dict_and_schedule_carry_the_search(self):
        sim = pipetrain.simulate("zb-auto", stages=2, microbatches=3, memory_limit=2, exact=True)
        r = pipetrain.zb_exact(2, 3, memory_limit=2)
        d = sim.to_dict()["exact"]
        self.assertEqual(d["makespan"], r.makespan)
        self.assertEqual(d["greedy_makespan"], r.greedy_makespan)
        self.assertAlmostEqual(d["gap_percent"], r.gap_percent)
        self.assertEqual((d["proven"], d["lower_bound"], d["nodes"]), (r.proven, r.lower_bound, r.nodes))
        self.assertNotIn("exact", pipetrain.simulate("zb-auto", stages=2, microbatches=3).to_dict())
        s, found = pipetrain.schedule("zb-auto", stages=2, microbatches=3, memory_limit=2, exact=True,
                                      return_exact=True)
        self.assertEqual(found.summary(), r.summary())
        self.assertEqual(s, r.schedule)
        self.assertIsNone(pipetrain.schedule("1f1b", stages=2, microbatches=2, return_exact=True)[1])


class MemoryUnits(unittest.TestCase):
    def test_validate_with_costs_speaks_in_the_costs_unit(self):
        s = pipetrain.schedule("1f1b", stages=2, microbatches=4)
        costs = pipetrain.stage_costs(small_profile(), [3, 3])
        with self.assertRaises(pipetrain.ScheduleError) as e:
            pipetrain.validate(s, memory_limit=3, costs=costs)
        self.assertNotIn("micro-batches of activations", str(e.exception))
        self.assertIn("the costs' activation unit", str(e.exception))
        with self.assertRaisesRegex(pipetrain.ScheduleError, "micro-batches of activations"):
            pipetrain.validate(s, memory_limit=1)
        self.assertIn("bytes", pipetrain.validate.__doc__)


class Paths(unittest.TestCase):
    def test_pathlike_everywhere(self):
        sim = pipetrain.simulate("1f1b", stages=2, microbatches=2)
        with tempfile.TemporaryDirectory() as d:
            d = pathlib.Path(d)
            sim.write_svg(d / "t.svg")
            sim.write_trace(d / "t.json")
            self.assertTrue((d / "t.svg").read_text().startswith("<"))
            self.assertIn("traceEvents", (d / "t.json").read_text())
            pipetrain.write_file(d / "s.csv", sim.schedule.to_csv())
            self.assertEqual(pipetrain.Schedule.load_csv(d / "s.csv"), sim.schedule)
            pipetrain.write_file(d / "t.csv", pipetrain.to_torch_csv(sim.schedule))
            self.assertEqual(pipetrain.load_torch_csv(d / "t.csv").schedule.ranks, 2)
            (d / "p.json").write_text(json.dumps(small_profile()))
            self.assertEqual(len(pipetrain.load_profile(d / "p.json")["layers"]), 6)
            with self.assertRaisesRegex(ValueError, "path is empty"):
                sim.write_svg("")
            with self.assertRaisesRegex(TypeError, "os.PathLike"):
                sim.write_svg(5)


class ClearErrors(unittest.TestCase):
    def test_each_names_the_keyword_and_value(self):
        sim = pipetrain.simulate("1f1b", stages=2, microbatches=2)
        cases = [
            (lambda: sim.ascii(-1), ValueError, "chars_per_unit=-1"),
            (lambda: sim.ascii(0), ValueError, "chars_per_unit=0"),
            (lambda: sim.ascii(float("nan")), ValueError, "chars_per_unit=nan"),
            (lambda: sim.ascii(1e12), ValueError, "chars_per_unit=1e\\+12 makes lines"),
            (lambda: pipetrain.ascii_gantt(sim.timeline, 0), ValueError, "chars_per_unit=0"),
            (lambda: pipetrain.CostModel.uniform(-3), ValueError, "stages=-3"),
            (lambda: sim.schedule.rank_of(-1), IndexError, r"stage=-1.*0\.\.1"),
            (lambda: pipetrain.schedule("1f1b", stages=4, microbatches=4, skips="0:3"), TypeError,
             "skips must be a list of strings"),
            (lambda: pipetrain.stages_per_rank("interleaved", 0), ValueError, "virtual=0"),
            (lambda: pipetrain.umpipe(vgg16(), [20, 19], 0), ValueError, "samples=0"),
        ]
        for f, kind, pattern in cases:
            with self.subTest(pattern=pattern), self.assertRaisesRegex(kind, pattern):
                f()
        self.assertEqual(sim.ascii(1).count("\n"), 2)


class ReleasesTheGil(unittest.TestCase):
    def test_other_threads_run_during_a_long_call(self):
        # Behaviour, not a timing: while zb_exact searches (about 0.5 s), this thread keeps running Python.
        # Holding the GIL, it would get back only after the call ends (a tick or two).
        started = threading.Event()

        def work():
            started.set()
            pipetrain.zb_exact(4, 8, memory_limit=3, nodes=100_000)

        t = threading.Thread(target=work)
        t.start()
        started.wait()
        ticks = 0
        while t.is_alive():
            ticks += 1
            time.sleep(0.001)
        t.join()
        self.assertGreater(ticks, 20)


class CostModelAndCostKeywords(unittest.TestCase):
    """A CostModel given to simulate() fixes the costs: cost keywords beside it are refused, not dropped (a
    tester's finding, 2026-11-28: comm=5 beside a CostModel gave the CostModel's makespan)."""

    def test_cost_keywords_beside_a_cost_model_are_refused(self):
        c = pipetrain.CostModel.uniform(4)
        base = pipetrain.simulate("1f1b", c, stages=4, microbatches=8).makespan
        self.assertEqual(base, pipetrain.simulate("1f1b", stages=4, microbatches=8).makespan)
        for kw in ({"comm": 5}, {"cost": "9:9:9"}, {"skips": ["0:3:4"], "skip_bandwidth": 0.01}, {"balance": "uniform"}):
            with self.subTest(kw=kw), self.assertRaisesRegex(TypeError, "costs= is a CostModel.*would do nothing"):
                pipetrain.simulate("1f1b", c, stages=4, microbatches=8, **kw)
        s = pipetrain.schedule("1f1b", stages=4, microbatches=8)
        with self.assertRaisesRegex(TypeError, r"comm=5 would do nothing"):
            pipetrain.simulate(s, c, comm=5)


class IntegerKeywords(unittest.TestCase):
    """A keyword the extension takes as an int: wrong types and values past int's range raise ValueError
    naming it (pybind11 listed a private function's positional values)."""

    def test_named_in_the_error(self):
        for kw, text in (({"stages": 2**31}, "stages=2147483648 is out of range"),
                         ({"stages": 4.5}, "stages=4.5 must be a whole number"),
                         ({"microbatches": 4.0}, "microbatches=4.0 must be a whole number"),
                         ({"stages": "4"}, "stages='4' must be a whole number"),
                         ({"stages": True}, "stages=True must be a whole number"),
                         ({"virtual": 2**40}, "virtual=1099511627776 is out of range")):
            with self.subTest(kw=kw), self.assertRaisesRegex(ValueError, text):
                pipetrain.simulate("1f1b", **dict({"stages": 2, "microbatches": 4}, **kw))

    def test_what_stands_for_an_int_is_taken(self):
        class Index:  # as numpy's integers: __index__, not an int
            def __init__(self, v):
                self.v = v

            def __index__(self):
                return self.v
        self.assertEqual(pipetrain.simulate("1f1b", stages=Index(2), microbatches=Index(4)).makespan,
                         pipetrain.simulate("1f1b", stages=2, microbatches=4).makespan)

    def test_a_pickled_zero_is_refused(self):
        s = pipetrain.schedule("1f1b", stages=2, microbatches=4)
        state, extra = s.__getstate__()
        state = list(state)
        state[4] = 0  # microbatches_per_step
        t = pipetrain.Schedule.__new__(pipetrain.Schedule)
        with self.assertRaisesRegex(ValueError, "microbatches_per_step=0 must be >= 1"):
            t.__setstate__((tuple(state), extra))



class ScheduleFieldsThatDivide(unittest.TestCase):
    """ranks and microbatches_per_step below 1 are refused when set (a 0 ended the interpreter with SIGFPE at
    the next repr or steps)."""

    def test_zero_is_refused_and_the_schedule_stays_usable(self):
        s = pipetrain.schedule("1f1b", stages=2, microbatches=4)
        with self.assertRaisesRegex(ValueError, "microbatches_per_step=0 must be >= 1"):
            s.microbatches_per_step = 0
        with self.assertRaisesRegex(ValueError, "ranks=-1 must be >= 1"):
            s.ranks = -1
        self.assertEqual((s.ranks, s.microbatches_per_step, s.steps, s.virtual_stages), (2, 4, 1, 1))
        self.assertIn("steps=1", repr(s))
        s.microbatches_per_step = 2
        self.assertEqual(s.steps, 2)


class ScheduleObjectKeywords(unittest.TestCase):
    """simulate(Schedule, ...) takes the generation keywords that equal the schedule's own (a tester's findings,
    2026-11-28: stages= was compared with the ranks, replication= and exact= always raised)."""

    def test_a_replicated_schedules_stages_and_replication_are_its_own(self):
        s = pipetrain.schedule("1f1b", stages=2, microbatches=6, replication=[3, 1])
        base = pipetrain.simulate(s).makespan
        self.assertEqual(pipetrain.simulate(s, stages=s.stages).makespan, base)
        self.assertEqual(pipetrain.simulate(s, replication=[3, 1], microbatches=6).makespan, base)
        with self.assertRaisesRegex(TypeError, r"stages=4 .*it has 2 stages, replicated \[3, 1\]"):
            pipetrain.simulate(s, stages=4)
        with self.assertRaisesRegex(TypeError, r"replication=\[2, 2\] .*replicas per stage \[3, 1\]"):
            pipetrain.simulate(s, replication=[2, 2])
        plain = pipetrain.schedule("1f1b", stages=2, microbatches=6)
        with self.assertRaisesRegex(TypeError, r"stages=3 .*it has 2 ranks; stages= counts the ranks"):
            pipetrain.simulate(plain, stages=3)
        with self.assertRaisesRegex(TypeError, "no replicated stages"):
            pipetrain.simulate(plain, replication=[1, 1])

    def test_exact_agrees_with_an_exact_built_schedule(self):
        e = pipetrain.schedule("zb-auto", stages=2, microbatches=3, memory_limit=2, exact=True, exact_nodes=100_000)
        sim = pipetrain.simulate(e, exact=True, exact_nodes=100_000)
        by_name = pipetrain.simulate("zb-auto", stages=2, microbatches=3, memory_limit=2, exact=True,
                                     exact_nodes=100_000)
        self.assertEqual(sim.to_dict(), by_name.to_dict())  # the search's summary included
        self.assertIn("exact", sim.to_dict())
        with self.assertRaisesRegex(TypeError, "exact_nodes=10 .*exact_nodes=100000"):
            pipetrain.simulate(e, exact=True, exact_nodes=10)
        with self.assertRaisesRegex(TypeError, "not built with exact=True"):
            pipetrain.simulate(pipetrain.schedule("zb-auto", stages=2, microbatches=3, memory_limit=2), exact=True)

    def test_a_v_shapes_virtual_is_taken_as_schedule_reads_it(self):
        v = pipetrain.schedule("zb-v", stages=2, microbatches=4)
        for virtual in (1, 2):  # schedule() takes both for the V shapes
            self.assertEqual(pipetrain.simulate(v, virtual=virtual).makespan, pipetrain.simulate(v).makespan)
        with self.assertRaisesRegex(TypeError, "virtual=3"):
            pipetrain.simulate(v, virtual=3)


class BuiltWithCosts(unittest.TestCase):
    """A Schedule remembers the costs schedule() built it with, and simulate()/costs() use them by default
    (the README's zb-auto at cost 1:1.5:1 was timed at 1:1:1)."""

    def test_simulated_at_the_costs_it_was_planned_for(self):
        s = pipetrain.schedule("zb-auto", stages=4, microbatches=12, cost="1:1.5:1", memory_limit=5)
        self.assertEqual(s.built_with["cost"], "1:1.5:1")
        by_name = pipetrain.simulate("zb-auto", stages=4, microbatches=12, cost="1:1.5:1", memory_limit=5)
        self.assertEqual(pipetrain.simulate(s).makespan, by_name.makespan)
        self.assertEqual(pipetrain.simulate(s, cost="1:1.5:1").makespan, by_name.makespan)
        unit = pipetrain.simulate(s, cost="1:1:1").makespan
        self.assertLess(unit, by_name.makespan)  # other costs when given
        self.assertEqual(pipetrain.costs(s).stage[0].b, 1.5)
        # Copies and pickles keep it; a schedule read from its CSV has none (as simulate --load).
        for back in (copy.deepcopy(s), copy.copy(s), pickle.loads(pickle.dumps(s))):
            self.assertEqual(pipetrain.simulate(back).makespan, by_name.makespan)
        loaded = pipetrain.Schedule.from_csv(s.to_csv())
        self.assertIsNone(loaded.built_with)
        self.assertEqual(pipetrain.simulate(loaded).makespan, unit)

    def test_given_keywords_replace_the_recorded_ones(self):
        s = pipetrain.schedule("1f1b", stages=2, microbatches=4, profile=small_profile(), balance="3,3")
        with_profile = pipetrain.simulate(s)
        self.assertAlmostEqual(with_profile.per_stage[0].busy, 4 * ((1 + 2 + 3) + (2 + 4 + 6)))
        # cost= replaces the recorded profile (no "both" conflict), comm= alone keeps it.
        self.assertEqual(pipetrain.simulate(s, cost="2:2:2").per_stage[0].busy, 4 * 6)
        self.assertAlmostEqual(pipetrain.simulate(s, balance="2,4").per_stage[0].busy, 4 * ((1 + 2) + (2 + 4)))

    def test_lower_strip_and_predict_heap_use_them_too(self):
        # A tester's finding (2026-11-28): lower(s) used unit costs and dropped built_with, so
        # simulate(lower(s)) timed zb-h1 at 1:1:1 (20.0 where s takes 32.0), and predict_heap(s) counted
        # micro-batches where simulate(s) gave a profile's bytes.
        s = pipetrain.schedule("zb-h1", stages=3, microbatches=6, cost="1:2:1", comm=0.5)
        lowered = pipetrain.lower(s)
        self.assertEqual(lowered.to_csv(), pipetrain.lower(s, pipetrain.costs(s)).to_csv())
        self.assertEqual(lowered.built_with["cost"], "1:2:1")
        self.assertEqual(pipetrain.simulate(lowered).makespan, pipetrain.simulate(s).makespan)
        self.assertEqual(pipetrain.strip_communication(lowered).built_with["comm"], 0.5)
        p = pipetrain.schedule("1f1b", stages=2, microbatches=4, profile=small_profile(), balance="3,3")
        self.assertEqual([h.total for h in pipetrain.predict_heap(p)], [h.total for h in pipetrain.simulate(p).heap])
        unit = pipetrain.schedule("1f1b", stages=2, microbatches=4)  # no costs recorded: micro-batches
        self.assertEqual(pipetrain.predict_heap(unit)[0].activations, 2.0)


class PipeDreamBatch(unittest.TestCase):
    """pipedream_batch= (--pipedream-batch), and the warning for a PipeDream graph read at batch 1."""

    VGG = os.path.join(DATA, "pipedream", "vgg16-graph.txt")

    def caught(self, f):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result = f()
        return result, [str(w.message) for w in seen if issubclass(w.category, UserWarning)]

    def test_simulate_and_search_plans_take_it(self):
        kw = dict(stages=2, microbatches=4, profile=self.VGG, balance="17,22", microbatch_size=16)
        at_1, said = self.caught(lambda: pipetrain.simulate("1f1b", **kw))
        self.assertTrue(any("PipeDream graph file" in w and "pipedream_batch" in w for w in said), said)
        at_128, said = self.caught(lambda: pipetrain.simulate("1f1b", pipedream_batch=128, **kw))
        self.assertEqual(said, [])
        self.assertAlmostEqual(at_1.makespan / at_128.makespan, 128, delta=1)  # the times scale with the batch
        plans, said = self.caught(lambda: pipetrain.search_plans(self.VGG, ranks=4, schedules=["1f1b"],
                                                                 microbatch_counts=[4], pipedream_batch=128))
        self.assertEqual(said, [])
        self.assertEqual(plans["batch_size"], 8 * 128)  # max(8, ranks) x the profiled batch
        _, said = self.caught(lambda: pipetrain.search_plans(self.VGG, ranks=4, schedules=["1f1b"],
                                                             microbatch_counts=[4]))
        self.assertTrue(any("pipedream_batch" in w for w in said), said)
        self.assertEqual(pipetrain.load_profile(self.VGG, pipedream_batch=128)["micro_batch_size"], 128)
        s, said = self.caught(lambda: pipetrain.schedule("zb-h2", stages=2, microbatches=4, profile=self.VGG,
                                                         pipedream_batch=128))
        self.assertEqual(said, [])
        self.assertEqual(s.built_with["pipedream_batch"], 128)

    def test_it_is_refused_where_it_means_nothing(self):
        with self.assertRaisesRegex(ValueError, "pipedream_batch is for a PipeDream graph file .* a dict"):
            pipetrain.simulate("1f1b", stages=2, microbatches=4, profile=small_profile(), pipedream_batch=128)
        with self.assertRaisesRegex(ValueError, "pipedream_batch=128 applies with profile="):
            pipetrain.simulate("1f1b", stages=2, microbatches=4, pipedream_batch=128)
        with self.assertRaisesRegex(ValueError, "pipedream_batch=-1 must be >= 1"):
            pipetrain.simulate("1f1b", stages=2, microbatches=4, profile=self.VGG, pipedream_batch=-1)


class ProfileKeywordsWithoutAProfile(unittest.TestCase):
    def test_they_are_refused_as_their_flags_are(self):
        # `simulate -s 1f1b -p 2 -m 2 --balance memory` ran at 1:1:1 without a word; so did the keywords.
        for key, value in (("balance", "memory"), ("balance", "1,1"), ("balance_solver", "block-partition"),
                           ("bandwidth", 1.0), ("latency", 5.0), ("microbatch_size", 16.0)):
            for f in (lambda: pipetrain.simulate("1f1b", stages=2, microbatches=2, **{key: value}),
                      lambda: pipetrain.schedule("1f1b", stages=2, microbatches=2, **{key: value}),
                      lambda: pipetrain.costs(pipetrain.schedule("1f1b", stages=2, microbatches=2), **{key: value})):
                with self.subTest(key=key), self.assertRaisesRegex(ValueError, f"{key}=.* applies with profile=.*"
                                                                               f"add profile=..., or drop {key}="):
                    f()
        # With a profile, given or recorded, they apply.
        s = pipetrain.schedule("1f1b", stages=2, microbatches=2, profile=small_profile(), balance="3,3")
        self.assertNotEqual(pipetrain.simulate(s, balance="1,5").makespan, pipetrain.simulate(s).makespan)


class AsynchronousSchedulesInTheSearch(unittest.TestCase):
    def test_they_are_named_not_dropped_silently(self):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            pipetrain.search_plans(small_profile(), ranks=2, schedules=["1f1b", "pipedream"], microbatch_counts=[4])
        said = [str(w.message) for w in seen]
        self.assertTrue(any("pipedream left out" in w and "asynchronous" in w for w in said), said)
        with self.assertRaisesRegex(ValueError, "only asynchronous schedules.*not searched.*PipeDream's own planner"):
            pipetrain.search_plans(small_profile(), ranks=2, schedules=["pipedream"])


class MemoryLimitAdvice(unittest.TestCase):
    def test_only_schedules_that_hold_fewer_are_advised(self):
        with self.assertRaises(pipetrain.ScheduleError) as e:
            pipetrain.simulate("1f1b", stages=4, microbatches=8, memory_limit=2)
        advice = str(e.exception).splitlines()[0].split("above the memory limit 2: ")[1]
        self.assertIn("v-min", advice)
        self.assertIn("v-half", advice)
        for name in ("1f1b", "zb-h1", "gpipe", "zb-h2"):
            self.assertNotRegex(advice, rf"(^|[ (,]){name} ")
        with self.assertRaises(pipetrain.ScheduleError) as e:
            pipetrain.simulate("v-min", stages=4, microbatches=8, memory_limit=1)
        advice = str(e.exception).splitlines()[0].split("above the memory limit 1: ")[1]
        self.assertIn("no other built-in schedule holds fewer", advice)
        for name in ("1f1b", "zb-h1", "v-half"):
            self.assertNotIn(name, advice)


class TorchBridgeVersion(unittest.TestCase):
    def test_the_minimum_pytorch_is_stated_once(self):
        # PyTorch 2.4's torch.distributed.pipelining has no _PipelineScheduleRuntime nor BACKWARD_INPUT: a stand-in
        # module without them gets the ImportError, which names the version the docstring names.
        import types
        from unittest import mock
        import pipetrain.torch as pt
        fake = {name: types.ModuleType(name) for name in
                ("torch", "torch.distributed", "torch.distributed.pipelining", "torch.distributed.pipelining.schedules")}
        fake["torch"].__version__ = "2.4.1"
        fake["torch"].distributed = fake["torch.distributed"]
        fake["torch.distributed"].pipelining = fake["torch.distributed.pipelining"]
        fake["torch.distributed.pipelining"].schedules = fake["torch.distributed.pipelining.schedules"]
        fake["torch.distributed.pipelining.schedules"].FORWARD = 1
        with mock.patch.dict(sys.modules, fake), self.assertRaises(ImportError) as e:
            pt.torch_actions(pipetrain.schedule("1f1b", stages=2, microbatches=2))
        self.assertIn("PyTorch 2.5 or newer", str(e.exception))
        self.assertIn("2.4.1", str(e.exception))
        self.assertIn("_PipelineScheduleRuntime", str(e.exception))
        self.assertIn("BACKWARD_INPUT", str(e.exception))
        self.assertIn("PyTorch 2.5 or newer", pt.__doc__)
        self.assertNotRegex(pt.__doc__ + str(e.exception), r"2\.4 or newer")


class InterruptingALongSearch(unittest.TestCase):
    """Ctrl-C during an exact search (tens of minutes at its largest budget) raised nothing until the
    search ended: the search now checks for a pending SIGINT every few thousand nodes."""

    def test_ctrl_c_raises_keyboard_interrupt(self):
        import signal
        if threading.current_thread() is not threading.main_thread():
            self.skipTest("signals reach the main thread only")
        costs = pipetrain.costs(pipetrain.schedule("1f1b", stages=6, microbatches=10), cost="2:3:1.5")
        for call in (lambda: pipetrain.zb_exact(6, 10, costs=costs, nodes=50_000_000),
                     lambda: pipetrain.schedule("zb-auto", stages=6, microbatches=10, cost="2:3:1.5", exact=True,
                                                exact_nodes=50_000_000)):
            timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
            timer.start()
            try:
                with self.assertRaises(KeyboardInterrupt):
                    call()  # 50 million nodes: minutes, were it not interrupted
            finally:
                timer.cancel()


if __name__ == "__main__":
    support.main()


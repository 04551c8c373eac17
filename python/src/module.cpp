// pipetrain's torch-free layers (core and plan) as the Python extension module `pipetrain._pipetrain`.
// The package `pipetrain` (python/pipetrain/__init__.py) re-exports these names and adds the
// keyword-argument front ends with the command line's defaults; python/pipetrain/__init__.pyi types both.
//
// Errors: UsageError (a bad value) arrives as ValueError with the library's message, the one the
// command line prints after "error: "; ScheduleError as pipetrain.ScheduleError, a ValueError whose
// message carries the step x rank grid. Other failures (a file that cannot be written) are RuntimeError.
#include <pybind11/functional.h>
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "pipetrain/core/action.h"
#include "pipetrain/core/cost.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/heap.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/schedule.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/simulate_json.h"
#include "pipetrain/core/skip.h"
#include "pipetrain/core/timeline.h"
#include "pipetrain/core/torch_csv.h"
#include "pipetrain/core/validate.h"
#include "pipetrain/core/zb_exact.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/costs.h"
#include "pipetrain/plan/planner.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/plan/search.h"
#include "pipetrain/plan/umpipe.h"

namespace py = pybind11;
using namespace pipetrain;

namespace {

// ---- JSON <-> Python (through the json module: exact for numbers, strings, lists and dicts) ----------
py::object to_python(const nlohmann::json& j) {
  return py::module_::import("json").attr("loads")(j.dump());
}
nlohmann::json from_python(const py::handle& obj) {
  const std::string text = py::module_::import("json").attr("dumps")(obj).cast<std::string>();
  return nlohmann::json::parse(text);
}

// A profile given as a dict (the JSON form), JSON text, or a path (JSON or PipeDream's graph text).
Profile to_profile(const py::handle& obj) {
  if (py::isinstance<py::dict>(obj)) return profile_from_json(from_python(obj), "profile");
  if (py::isinstance<py::str>(obj)) {
    const std::string text = obj.cast<std::string>();
    const auto first = text.find_first_not_of(" \t\r\n");
    if (first != std::string::npos && text[first] == '{') return profile_from_json_text(text, "profile");
    return load_profile(text);
  }
  if (py::hasattr(obj, "__fspath__")) return load_profile(py::str(obj.attr("__fspath__")()).cast<std::string>());
  throw UsageError("a profile is a dict (the JSON form of docs/PROFILE.md), JSON text or a file path; got " +
                   py::str(py::type::of(obj)).cast<std::string>());
}

ActionKind parse_kind(const std::string& name) {
  static const std::vector<std::pair<const char*, ActionKind>> kinds{
      {"F", ActionKind::F},        {"B", ActionKind::B},        {"W", ActionKind::W},
      {"BW", ActionKind::BW},      {"SF", ActionKind::SendAct}, {"RF", ActionKind::RecvAct},
      {"SB", ActionKind::SendGrad}, {"RB", ActionKind::RecvGrad}, {"S", ActionKind::Step}};
  for (const auto& [n, k] : kinds)
    if (name == n) return k;
  throw UsageError("action kind '" + name + "' is not one of F, B, W, BW, SF, RF, SB, RB, S");
}

// ---- what `pipetrain schedule` / `simulate` do with their flags (apps/pipetrain/cli_common.cpp) --------
struct CostFlags {
  std::string cost = "1:1:1";
  double comm = 0.0;
  py::object profile = py::none();
  std::string balance = "time";
  std::string balance_solver = "min-max";
  double microbatch_size = 0;
  std::optional<double> bandwidth;  // GB/s
  std::optional<double> latency;    // us
  double skip_bandwidth = 0;
};

std::pair<double, double> transfer_options(const CostFlags& f, const Profile& p) {
  if (f.bandwidth.value_or(0) < 0 || f.latency.value_or(0) < 0) throw UsageError("bandwidth and latency must be >= 0");
  if (!f.bandwidth && !f.latency)
    if (const auto t = profile_transfers(p)) return {t->bandwidth_bytes_per_ms, t->latency_ms};
  return {f.bandwidth.value_or(0) * 1e6, f.latency.value_or(0) / 1e3};
}

CostModel profile_costs(const CostFlags& f, const Profile& p, int total_stages) {
  if (f.microbatch_size < 0) throw UsageError("microbatch_size must be > 0");
  const std::vector<int> b = plan_balance(p, total_stages, f.balance, parse_balance_solver(f.balance_solver));
  StageCostOptions o;
  o.micro_batch = f.microbatch_size > 0 ? f.microbatch_size : p.micro_batch_size;
  std::tie(o.bandwidth_bytes_per_ms, o.latency_ms) = transfer_options(f, p);
  return stage_costs(p, b, o);
}

CostModel flag_costs(const CostFlags& f, const Schedule& s) {
  if (f.skip_bandwidth < 0 || !(f.skip_bandwidth < 1e300))
    throw UsageError("skip_bandwidth " + std::to_string(f.skip_bandwidth) + " must be finite and >= 0 (0: unlimited)");
  CostModel c;
  if (!f.profile.is_none()) {
    const Profile p = to_profile(f.profile);
    c = profile_costs(f, p, s.stages);
    if (s.replicated()) {
      std::vector<int> counts;
      for (int st = 0; st < s.stages; ++st) counts.push_back(s.replicas_of(st));
      const auto [bandwidth, latency] = transfer_options(f, p);
      add_stage_step(c, replica_allreduce_ms(p, plan_balance(p, s.stages, f.balance, parse_balance_solver(f.balance_solver)),
                                             counts, bandwidth, latency));
    }
  } else {
    const std::vector<StageCost> given = parse_stage_costs(f.cost);
    if (f.comm < 0) throw UsageError("comm " + std::to_string(f.comm) + " must be >= 0");
    c = costs_from_triples(s, given, f.comm, "cost");
  }
  c.bandwidth = f.skip_bandwidth;
  return c;
}

void add_skips(Schedule& s, const std::vector<std::string>& skips) {
  if (skips.empty()) return;
  if (!s.skips.empty()) throw UsageError("the schedule already declares skip routes: drop skips=");
  for (const std::string& text : skips) s.skips.push_back(parse_skip_route(text));
  try {
    check_skip_routes(s);
  } catch (const UsageError& e) {
    throw UsageError(std::string("skips: ") + e.what());
  }
}

ValidateOptions validate_options(double memory_limit) {
  ValidateOptions vo;
  if (memory_limit > 0) vo.memory_limit = memory_limit;
  return vo;
}

std::string names_text() {
  std::string names;
  for (const auto& n : schedule_names()) names += (names.empty() ? "" : ", ") + n;
  return names;
}

// ScheduleFlags::build and ExactFlags::apply.
Schedule make_schedule(const std::string& name, int stages, int microbatches, int virtual_stages, int steps,
                       double memory_limit, const std::vector<int>& replication, const std::vector<std::string>& skips,
                       bool exact, long long exact_nodes, const CostFlags& cf, ZbExactResult* found) {
  if (name.empty()) throw UsageError("missing schedule: choose one of " + names_text());
  Schedule s;
  if (!replication.empty()) {
    if (stages != 0 && stages != static_cast<int>(replication.size()))
      throw UsageError("replication lists " + std::to_string(replication.size()) + " stages but stages is " +
                       std::to_string(stages) + ": give one replica count per stage (or drop stages)");
    if (virtual_stages != 1) throw UsageError("replication runs without virtual stages: drop virtual");
    if (exact) throw UsageError("exact plans one rank per stage: drop replication");
    s = round_robin(name, replication, microbatches, steps);
    add_skips(s, skips);
    validate(s, validate_options(memory_limit));
    return s;
  }
  GeneratorOptions o;
  o.ranks = stages;
  o.microbatches = microbatches;
  o.virtual_stages = virtual_stages;
  o.steps = steps;
  o.memory_limit = memory_limit;
  if (name == "zb-h2" || name == "zb-auto") {
    if (stages < 1) throw UsageError("stages must be >= 1, got " + std::to_string(stages));
    if (!cf.profile.is_none()) {
      o.costs = profile_costs(cf, to_profile(cf.profile), stages * virtual_stages);
    } else {
      o.costs.stage = parse_stage_costs(cf.cost);
      o.costs.comm = cf.comm;
      if (o.costs.stage.size() != 1 && static_cast<int>(o.costs.stage.size()) != stages)
        throw UsageError("cost lists " + std::to_string(o.costs.stage.size()) + " stages but stages is " +
                         std::to_string(stages) + ": give one F:B:W triple, or one per stage");
    }
  }
  s = generate(name, o);
  if (exact) {
    if (name != "zb-auto")
      throw UsageError("exact searches zb-auto's schedules: use schedule zb-auto (not " + name + ")");
    if (!skips.empty())
      throw UsageError("exact searches schedules without skip routes (its memory limit and bounds leave out the "
                       "skips' memory and transfers), but skip " + skips.front() + " was given: drop skips to search");
    ZbExactOptions zo;
    zo.memory_limit = memory_limit;
    zo.node_budget = exact_nodes;
    zo.steps = steps;
    ZbExactResult r = zb_exact(s.ranks, s.microbatches_per_step, flag_costs(cf, s), zo);
    validate(r.schedule, validate_options(memory_limit));
    s = r.schedule;
    if (found) *found = r;
    return s;
  }
  add_skips(s, skips);
  validate(s, validate_options(memory_limit));
  return s;
}

// ---- simulation -------------------------------------------------------------------------------------
struct Simulation {
  Schedule schedule;
  CostModel costs;
  SimResult result;
  std::vector<HeapPeak> heap;
  HeapOptions policy;
};

Simulation run_simulation(const Schedule& s, const CostModel& costs, const HeapOptions& policy) {
  Simulation out;
  out.schedule = s;
  out.costs = costs;
  out.result = simulate(s, costs);
  out.heap = predict_heap(s, costs, policy);
  out.policy = policy;
  return out;
}

// The object `pipetrain simulate --json` prints, key for key (core/simulate_json.h).
nlohmann::json simulation_json(const Simulation& sim) {
  return pipetrain::simulation_json(sim.schedule, sim.result, sim.heap, sim.policy);
}

std::string fixed(double v, int digits) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(digits);
  o << v;
  return o.str();
}

std::string pad(const std::string& s, std::size_t width) {
  return s.size() >= width ? s : std::string(width - s.size(), ' ') + s;
}

// The table `pipetrain simulate` prints.
std::string simulation_table(const Simulation& sim) {
  const Schedule& s = sim.schedule;
  const Metrics& m = sim.result.metrics;
  std::ostringstream out;
  out << "schedule " << s.name << "  p=" << s.ranks << "  m=" << s.microbatches_per_step
      << "  v=" << s.virtual_stages_per_rank() << "  steps=" << s.steps() << "\n";
  out << "makespan " << fixed(m.makespan, 3) << "   bubble fraction " << fixed(m.bubble_fraction, 4)
      << "   max per-stage bubble " << fixed(m.max_bubble(), 3) << "\n";
  out << pad("stage", 5) << "  " << pad("busy", 10) << "  " << pad("span", 10) << "  " << pad("bubble", 10) << "  "
      << pad("peak in-flight", 14) << "  " << pad("peak memory", 12) << "\n";
  for (const RankMetrics& r : m.per_rank)
    out << pad(std::to_string(r.rank), 5) << "  " << pad(fixed(r.busy, 3), 10) << "  " << pad(fixed(r.span, 3), 10)
        << "  " << pad(fixed(r.bubble, 3), 10) << "  " << pad(std::to_string(r.peak_inflight), 14) << "  "
        << pad(fixed(r.peak_memory, 3), 12) << "\n";
  return out.str();
}

// ---- plan search -> dict ------------------------------------------------------------------------------
nlohmann::json candidate_json(const PlanCandidate& c) {
  return {{"kind", c.kind},         {"solver", c.solver},   {"schedule", c.schedule},
          {"m", c.m},               {"balance", c.balance}, {"replication", c.replication},
          {"makespan", c.makespan}, {"bubble", c.bubble},   {"peak_bytes", c.peak_bytes},
          {"fits", c.fits},         {"stages", c.stages},   {"virtual_stages", c.virtual_stages},
          {"replicas", c.replicas}, {"ranks_used", c.ranks_used}, {"samples", c.samples},
          {"allreduce_ms", c.allreduce_ms}, {"placement", c.placement}, {"copies", c.copies}};
}

nlohmann::json search_json(const Profile& profile, const PlanSearchResult& r) {
  nlohmann::json j;
  j["batch_size"] = r.batch_size;
  j["candidates"] = nlohmann::json::array();
  for (const PlanCandidate& c : r.candidates) j["candidates"].push_back(candidate_json(c));
  j["best_straight"] = candidate_json(r.best_straight);
  j["uniform_1f1b"] = r.uniform_1f1b ? candidate_json(*r.uniform_1f1b) : nlohmann::json();
  j["data_parallel"] = {{"ms", r.data_parallel_ms}, {"bytes", r.data_parallel_bytes}, {"fits", r.data_parallel_fits}};
  if (r.data_parallel) j["data_parallel"]["candidate"] = candidate_json(*r.data_parallel);
  j["considered"] = r.considered;
  j["pipedream"] = r.pipedream ? plan_to_json(*r.pipedream) : nlohmann::json();
  j["pipedream_error"] = r.pipedream_error;
  j["replicated"] = r.replicated ? candidate_json(*r.replicated) : nlohmann::json();
  j["pipedream_copies"] = nlohmann::json::array();  // PipeDream's plan for R/d ranks x d copies, per d tried
  for (std::size_t i = 0; i < r.pipedream_copies.size(); ++i) {
    nlohmann::json c = candidate_json(r.pipedream_copies[i]);
    c["plan"] = plan_to_json(r.pipedream_copy_plans[i]);
    j["pipedream_copies"].push_back(std::move(c));
  }
  j["chose_replicated"] = r.chose_replicated;
  j["chosen"] = candidate_json(r.chosen());
  j["plan_file"] = plan_file_to_json(plan_file_for(profile, r));
  return j;
}

std::vector<NetworkLevel> to_levels(const py::object& levels) {
  std::vector<NetworkLevel> out;
  if (levels.is_none()) return out;
  for (const py::handle& item : levels) {
    if (py::isinstance<py::str>(item)) {
      const std::string lv = item.cast<std::string>();
      const auto colon = lv.find(':');
      try {
        if (colon == std::string::npos) throw std::invalid_argument(lv);
        out.push_back(NetworkLevel{std::stoi(lv.substr(0, colon)), std::stod(lv.substr(colon + 1)) * 1e9});
      } catch (const std::exception&) {
        throw UsageError("level " + lv + " must read MACHINES:GB/s, e.g. 4:100");
      }
    } else {
      const auto t = item.cast<std::pair<int, double>>();
      out.push_back(NetworkLevel{t.first, t.second * 1e9});
    }
    if (out.back().machines < 1 || !(out.back().bandwidth > 0) || !std::isfinite(out.back().bandwidth))
      throw UsageError("a level needs MACHINES >= 1 and a finite GB/s > 0, e.g. 4:100 or (4, 100.0)");
  }
  return out;
}

void check_transfer_flags(double bandwidth_gbps, double latency_us, double memory_gib) {
  if (!(bandwidth_gbps > 0)) throw UsageError("bandwidth must be > 0 GB/s, got " + std::to_string(bandwidth_gbps));
  if (!std::isfinite(bandwidth_gbps))
    throw UsageError("bandwidth must be a finite number of GB/s, got " + std::to_string(bandwidth_gbps));
  if (latency_us < 0) throw UsageError("latency must be >= 0 us, got " + std::to_string(latency_us));
  if (memory_gib < 0) throw UsageError("memory must be >= 0 GiB, got " + std::to_string(memory_gib));
}

// The transfers `pipetrain plan` plans with: the flags, or a measured profile's when neither is given.
std::pair<double, double> plan_transfers(const Profile& prof, std::optional<double> bandwidth, std::optional<double> latency) {
  double gbps = bandwidth.value_or(10.0), us = latency.value_or(50.0);
  if (!bandwidth && !latency)
    if (const auto t = profile_transfers(prof)) {
      gbps = t->bandwidth_bytes_per_ms / 1e6;
      us = t->latency_ms * 1e3;
    }
  return {gbps, us};
}

}  // namespace

PYBIND11_MODULE(_pipetrain, m) {
  m.doc() = "pipetrain's torch-free layers (schedules, validation, lowering, simulation, heap model, timelines, "
            "profiles, balances, planners, PyTorch's schedule CSV). Use the package `pipetrain`, which re-exports "
            "these names.";

  static py::exception<ScheduleError> schedule_error(m, "ScheduleError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ScheduleError& e) {
      PyErr_SetString(schedule_error.ptr(), e.what());
    } catch (const UsageError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  // ---- actions and schedules ----
  py::class_<Action>(m, "Action",
                     "One unit of work on one rank: kind ('F' forward, 'B' input gradient, 'W' weight gradient, 'BW' "
                     "fused backward, 'SF'/'RF' send/receive activation, 'SB'/'RB' send/receive gradient, 'S' "
                     "optimizer step), the (virtual) stage, the micro-batch (the step number for 'S'). Text form "
                     "<stage><KIND><index>, e.g. 2F0; a skip transfer adds @<peer stage>.")
      .def(py::init([](const std::string& kind, int stage, int index, bool paired, int peer) {
             Action a;
             a.kind = parse_kind(kind);
             a.stage = stage;
             a.index = index;
             a.paired = paired;
             a.peer = peer;
             return a;
           }),
           py::arg("kind"), py::arg("stage"), py::arg("index"), py::arg("paired") = false, py::arg("peer") = -1)
      .def_static("parse", &parse_action, py::arg("text"), "Parses the text form, e.g. '2F0' or '0SF2@3'.")
      .def_property(
          "kind", [](const Action& a) { return std::string(kind_name(a.kind)); },
          [](Action& a, const std::string& k) { a.kind = parse_kind(k); }, "'F', 'B', 'W', 'BW', 'SF', 'RF', 'SB', 'RB' or 'S'")
      .def_readwrite("stage", &Action::stage, "virtual stage, numbered from the input side")
      .def_readwrite("index", &Action::index, "micro-batch (global over steps), or the step number for 'S'")
      .def_readwrite("paired", &Action::paired, "opens a paired slot with the rank's next compute action")
      .def_readwrite("peer", &Action::peer, "skip transfers: the peer stage; -1 = the neighbouring stage")
      .def_property_readonly("microbatch", [](const Action& a) { return a.index; }, "alias of index")
      .def_property_readonly("is_compute", [](const Action& a) { return is_compute(a.kind); }, "F, B, W or BW")
      .def_property_readonly("is_comm", [](const Action& a) { return is_comm(a.kind); }, "SF, RF, SB or RB")
      .def("__str__", [](const Action& a) { return to_string(a); })
      .def("__repr__", [](const Action& a) { return "Action('" + to_string(a) + "')"; })
      .def(py::self == py::self)
      .def(py::self != py::self)
      .def(py::self < py::self)
      .def("__hash__", [](const Action& a) { return std::hash<Action>{}(a); });

  py::class_<SkipEdge>(m, "SkipEdge", "A skip connection: from_stage stashes a tensor of `size` that to_stage pops.")
      .def(py::init([](int from, int to, double size) { return SkipEdge{from, to, size}; }), py::arg("from_stage"),
           py::arg("to_stage"), py::arg("size") = 1.0)
      .def_readwrite("from_stage", &SkipEdge::from_stage)
      .def_readwrite("to_stage", &SkipEdge::to_stage)
      .def_readwrite("size", &SkipEdge::size)
      .def("__repr__", [](const SkipEdge& k) {
        return "SkipEdge(" + std::to_string(k.from_stage) + ", " + std::to_string(k.to_stage) + ", " + py::repr(py::float_(k.size)).cast<std::string>() + ")";
      });

  py::class_<Schedule>(m, "Schedule",
                       "Per rank, the ordered list of actions it runs (actions[r]). Made by pipetrain.schedule(), "
                       "Schedule.from_csv() or pipetrain.from_torch_csv(); str() gives one line per rank.")
      .def(py::init<>())
      .def_readwrite("name", &Schedule::name)
      .def_readwrite("ranks", &Schedule::ranks, "p: ranks (devices, processes)")
      .def_readwrite("stages", &Schedule::stages, "S: (virtual) stages, p * v for the looped and V schedules")
      .def_readwrite("microbatches", &Schedule::microbatches, "micro-batches over all steps")
      .def_readwrite("microbatches_per_step", &Schedule::microbatches_per_step)
      .def_readwrite("synchronous", &Schedule::synchronous, "flushes at every optimizer step")
      .def_readwrite("stage_rank", &Schedule::stage_rank, "stage_rank[s]: the rank that owns stage s")
      .def_readwrite("stage_replicas", &Schedule::stage_replicas, "per stage its replicas' ranks (1F1B-RR); [] if none")
      .def_readwrite("actions", &Schedule::actions,
                     "actions[r]: rank r's actions in order (a copy: assign a whole list to change it)")
      .def_readwrite("skips", &Schedule::skips)
      .def_property_readonly("steps", &Schedule::steps, "optimizer steps")
      .def_property_readonly("virtual_stages", &Schedule::virtual_stages_per_rank, "stages per rank")
      .def("rank_of", py::overload_cast<int>(&Schedule::rank_of, py::const_), py::arg("stage"))
      .def("rank_line", [](const Schedule& s, int r) {
             if (r < 0 || r >= s.ranks) throw py::index_error("rank " + std::to_string(r) + " of " + std::to_string(s.ranks));
             return rank_line(s, r);
           }, py::arg("rank"), "Rank r's actions as one line of text, one cell per word.")
      .def("text", [](const Schedule& s) {
             std::string out;
             for (const SkipEdge& k : s.skips)
               out += "skip " + std::to_string(k.from_stage) + " -> " + std::to_string(k.to_stage) + " size " +
                      py::str(py::float_(k.size)).cast<std::string>() + "\n";
             for (int r = 0; r < s.ranks; ++r) out += "rank " + std::to_string(r) + ": " + rank_line(s, r) + "\n";
             return out;
           }, "The text `pipetrain schedule` prints: one line 'rank r: ...' per rank.")
      .def("to_csv", [](const Schedule& s) { return to_csv(s); }, "pipetrain's CSV form (pipetrain schedule --format csv).")
      .def_static("from_csv", &from_csv, py::arg("text"), "Parses pipetrain's CSV form.")
      .def_static("load_csv", &load_csv_file, py::arg("path"), "Reads pipetrain's CSV form from a file.")
      .def("__str__", [](const Schedule& s) {
        std::string out;
        for (int r = 0; r < s.ranks; ++r) out += "rank " + std::to_string(r) + ": " + rank_line(s, r) + "\n";
        return out;
      })
      .def("__repr__", [](const Schedule& s) {
        return "<pipetrain.Schedule " + s.name + " p=" + std::to_string(s.ranks) + " stages=" + std::to_string(s.stages) +
               " m=" + std::to_string(s.microbatches_per_step) + " steps=" + std::to_string(s.steps()) + ">";
      })
      .def(py::self == py::self)
      .def("__copy__", [](const Schedule& s) { return s; })
      .def("__deepcopy__", [](const Schedule& s, py::dict) { return s; }, py::arg("memo"));

  m.def("parse_action", &parse_action, py::arg("text"), "Parses one action's text form, e.g. '2F0'.");
  m.def("parse_cell", &parse_cell, py::arg("text"), "Parses one cell: an action, or a pair '(0F7;7BW3)'.");
  m.def("schedule_names", &schedule_names, "The schedule names pipetrain.schedule() accepts, in the order shown to users.");
  m.def("schedule_traits", [](const std::string& name) {
          const ScheduleTraits t = schedule_traits(name);
          py::dict d;
          d["synchronous"] = t.synchronous;
          d["one_microbatch_per_step"] = t.one_microbatch_per_step;
          d["virtual_stages"] = t.virtual_stages;
          d["split_backward"] = t.split_backward;
          d["v_shape"] = t.v_shape;
          return d;
        }, py::arg("name"), "What a schedule name promises (synchronous, split backward, V shape, ...).");
  m.def("stages_per_rank", &stages_per_rank, py::arg("name"), py::arg("virtual") = 1);

  // ---- costs ----
  py::class_<StageCost>(m, "StageCost", "Per-micro-batch costs of one (virtual) stage.")
      .def(py::init([](double f, double b, double w, double activation, double gradient_b, double gradient_w,
                       double message) { return StageCost{f, b, w, activation, gradient_b, gradient_w, message}; }),
           py::arg("f") = 1.0, py::arg("b") = 1.0, py::arg("w") = 1.0, py::arg("activation") = 1.0,
           py::arg("gradient_b") = 0.0, py::arg("gradient_w") = 0.0, py::arg("message") = 0.0)
      .def_readwrite("f", &StageCost::f, "forward time")
      .def_readwrite("b", &StageCost::b, "input-gradient backward time")
      .def_readwrite("w", &StageCost::w, "weight-gradient backward time")
      .def_readwrite("activation", &StageCost::activation, "activation memory of one micro-batch")
      .def_readwrite("gradient_b", &StageCost::gradient_b)
      .def_readwrite("gradient_w", &StageCost::gradient_w)
      .def_readwrite("message", &StageCost::message)
      .def_readwrite("w_held", &StageCost::w_held,
                     "heap model: what a micro-batch holds between its B and its W; < 0: activation x (1 - "
                     "b_release_fraction)")
      .def("__repr__", [](const StageCost& c) {
        auto f = [](double v) { return py::repr(py::float_(v)).cast<std::string>(); };
        return "StageCost(f=" + f(c.f) + ", b=" + f(c.b) + ", w=" + f(c.w) + ", activation=" + f(c.activation) + ")";
      });

  py::class_<CostModel>(m, "CostModel",
                        "Per-stage times and memory, transfer and step times: what the simulator reads. `stage` is a "
                        "copy: assign a whole list to change it.")
      .def(py::init([](std::vector<StageCost> stage, double comm, double step, double bandwidth,
                       std::vector<double> stage_step, double b_release_fraction, double overhead) {
             CostModel c;
             c.stage = std::move(stage);
             c.comm = comm;
             c.step = step;
             c.bandwidth = bandwidth;
             c.stage_step = std::move(stage_step);
             c.b_release_fraction = b_release_fraction;
             c.overhead = overhead;
             return c;
           }),
           py::arg("stage") = std::vector<StageCost>{}, py::arg("comm") = 0.0, py::arg("step") = 0.0,
           py::arg("bandwidth") = 0.0, py::arg("stage_step") = std::vector<double>{},
           py::arg("b_release_fraction") = 0.5, py::arg("overhead") = 0.0)
      .def_static("uniform", &CostModel::uniform, py::arg("stages"), py::arg("per_stage") = StageCost{},
                  py::arg("virtual_per_rank") = 1, py::arg("comm") = 0.0,
                  "Every stage costs per_stage, split evenly over virtual_per_rank chunks.")
      .def_readwrite("stage", &CostModel::stage)
      .def_readwrite("comm", &CostModel::comm, "time of one transfer between ranks")
      .def_readwrite("step", &CostModel::step, "time of an optimizer step")
      .def_readwrite("bandwidth", &CostModel::bandwidth, "memory units per time unit of a skip transfer; 0 unlimited")
      .def_readwrite("stage_step", &CostModel::stage_step)
      .def_readwrite("b_release_fraction", &CostModel::b_release_fraction)
      .def_readwrite("overhead", &CostModel::overhead, "the runtime's time per compute action")
      .def("duration", &CostModel::duration, py::arg("action"))
      .def("memory_delta", &CostModel::memory_delta, py::arg("action"))
      .def("check", &CostModel::check, py::arg("stages"))
      .def("__repr__", [](const CostModel& c) {
        return "<pipetrain.CostModel " + std::to_string(c.stage.size()) + " stages, comm=" +
               py::repr(py::float_(c.comm)).cast<std::string>() + ">";
      });
  m.def("parse_stage_costs", &parse_stage_costs, py::arg("text"),
        "Parses 'F:B:W' (all stages) or 'F:B:W,F:B:W,...' (one per stage), as --cost.");

  m.def(
      "_costs",
      [](const Schedule& s, const std::string& cost, double comm, py::object profile, const std::string& balance,
         const std::string& balance_solver, double microbatch_size, std::optional<double> bandwidth,
         std::optional<double> latency, double skip_bandwidth) {
        CostFlags f{cost, comm, std::move(profile), balance, balance_solver, microbatch_size, bandwidth, latency, skip_bandwidth};
        return flag_costs(f, s);
      },
      py::arg("schedule"), py::arg("cost"), py::arg("comm"), py::arg("profile"), py::arg("balance"),
      py::arg("balance_solver"), py::arg("microbatch_size"), py::arg("bandwidth"), py::arg("latency"),
      py::arg("skip_bandwidth"));

  m.def(
      "_schedule",
      [](const std::string& name, int stages, int microbatches, int virtual_stages, int steps, double memory_limit,
         const std::vector<int>& replication, const std::vector<std::string>& skips, bool exact, long long exact_nodes,
         const std::string& cost, double comm, py::object profile, const std::string& balance,
         const std::string& balance_solver, double microbatch_size, std::optional<double> bandwidth,
         std::optional<double> latency) {
        CostFlags f{cost, comm, std::move(profile), balance, balance_solver, microbatch_size, bandwidth, latency, 0.0};
        ZbExactResult found;
        Schedule s = make_schedule(name, stages, microbatches, virtual_stages, steps, memory_limit, replication, skips,
                                   exact, exact_nodes, f, exact ? &found : nullptr);
        py::object summary = py::none();
        if (exact) summary = py::str(found.summary());
        return py::make_tuple(s, summary);
      },
      py::arg("name"), py::arg("stages"), py::arg("microbatches"), py::arg("virtual"), py::arg("steps"),
      py::arg("memory_limit"), py::arg("replication"), py::arg("skips"), py::arg("exact"), py::arg("exact_nodes"),
      py::arg("cost"), py::arg("comm"), py::arg("profile"), py::arg("balance"), py::arg("balance_solver"),
      py::arg("microbatch_size"), py::arg("bandwidth"), py::arg("latency"));

  // ---- validation and lowering ----
  m.def(
      "validate",
      [](const Schedule& s, double memory_limit, std::optional<CostModel> costs) {
        ValidateOptions vo = validate_options(memory_limit);
        if (costs) vo.costs = *costs;
        validate(s, vo);
      },
      py::arg("schedule"), py::arg("memory_limit") = 0.0, py::arg("costs") = py::none(),
      "Checks sizes, completeness, order, deadlock freedom and (memory_limit > 0) activation memory per rank in "
      "micro-batches. Raises pipetrain.ScheduleError (a ValueError) whose message carries the step x rank grid "
      "with the offending cell marked.");
  m.def("render_grid", [](const Schedule& s, const std::vector<std::pair<int, int>>& marked) {
          std::vector<GridCell> cells;
          for (const auto& [r, p] : marked) cells.push_back(GridCell{r, p});
          return render_grid(s, cells);
        }, py::arg("schedule"), py::arg("marked") = std::vector<std::pair<int, int>>{},
        "The step x rank grid, marking the (rank, position) cells given.");
  m.def("lower", [](const Schedule& s, std::optional<CostModel> costs) { return insert_communication(s, costs.value_or(CostModel{})); },
        py::arg("schedule"), py::arg("costs") = py::none(),
        "Inserts the send and receive actions (pipetrain schedule --lower), in an order that cannot deadlock on "
        "blocking transports. costs (default: F = B = W = 1) only decide how early transfers are posted.");
  m.def("strip_communication", &strip_communication, py::arg("schedule"), "The inverse of lower().");

  // ---- timelines, metrics, writers ----
  py::class_<TimedAction>(m, "TimedAction", "One action of a timeline: rank, action, start, end.")
      .def(py::init([](int rank, const Action& a, double start, double end) { return TimedAction{rank, a, start, end}; }),
           py::arg("rank"), py::arg("action"), py::arg("start"), py::arg("end"))
      .def_readwrite("rank", &TimedAction::rank)
      .def_readwrite("action", &TimedAction::action)
      .def_readwrite("start", &TimedAction::start)
      .def_readwrite("end", &TimedAction::end)
      .def("__repr__", [](const TimedAction& t) {
        return "TimedAction(rank=" + std::to_string(t.rank) + ", action=" + to_string(t.action) + ", start=" +
               py::repr(py::float_(t.start)).cast<std::string>() + ", end=" + py::repr(py::float_(t.end)).cast<std::string>() + ")";
      });
  py::class_<Timeline>(m, "Timeline", "When each action ran on each rank (simulated or measured).")
      .def(py::init<>())
      .def_readwrite("schedule", &Timeline::schedule)
      .def_readwrite("ranks", &Timeline::ranks)
      .def_readwrite("microbatches", &Timeline::microbatches)
      .def_readwrite("total_microbatches", &Timeline::total_microbatches)
      .def_readwrite("virtual_stages", &Timeline::virtual_stages)
      .def_readwrite("unit", &Timeline::unit)
      .def_readwrite("events", &Timeline::events, "list of TimedAction (a copy)")
      .def("records", [](const Timeline& t) {
             py::list out;
             for (const TimedAction& e : t.events) {
               py::dict d;
               d["rank"] = e.rank;
               d["action"] = to_string(e.action);
               d["kind"] = std::string(kind_name(e.action.kind));
               d["stage"] = e.action.stage;
               d["microbatch"] = e.action.index;
               d["start"] = e.start;
               d["end"] = e.end;
               out.append(d);
             }
             return out;
           }, "The events as dicts: rank, action (text), kind, stage, microbatch, start, end.")
      .def("__len__", [](const Timeline& t) { return t.events.size(); });
  py::class_<RankMetrics>(m, "RankMetrics", "busy, span, bubble (= span - busy), peak in-flight micro-batches, peak activation memory of one rank")
      .def_readonly("rank", &RankMetrics::rank)
      .def_readonly("busy", &RankMetrics::busy)
      .def_readonly("span", &RankMetrics::span)
      .def_readonly("bubble", &RankMetrics::bubble)
      .def_readonly("peak_inflight", &RankMetrics::peak_inflight)
      .def_readonly("peak_memory", &RankMetrics::peak_memory)
      .def("__repr__", [](const RankMetrics& r) {
        auto f = [](double v) { return py::repr(py::float_(v)).cast<std::string>(); };
        return "RankMetrics(rank=" + std::to_string(r.rank) + ", busy=" + f(r.busy) + ", span=" + f(r.span) +
               ", bubble=" + f(r.bubble) + ", peak_inflight=" + std::to_string(r.peak_inflight) +
               ", peak_memory=" + f(r.peak_memory) + ")";
      });
  py::class_<Metrics>(m, "Metrics")
      .def_readonly("makespan", &Metrics::makespan)
      .def_readonly("bubble_fraction", &Metrics::bubble_fraction, "1 - sum(busy) / (p * makespan)")
      .def_readonly("per_rank", &Metrics::per_rank)
      .def_property_readonly("max_bubble", &Metrics::max_bubble, "max over ranks of span - busy (zero-bubble papers)");
  m.def("compute_metrics", &compute_metrics, py::arg("timeline"), "Busy, span, bubble and makespan from the events alone.");
  m.def("chrome_trace_json", &chrome_trace_json, py::arg("timeline"), "Chrome trace JSON text (Perfetto, chrome://tracing).");
  m.def("gantt_svg", [](const Timeline& t, std::optional<Metrics> metrics) { return gantt_svg(t, metrics ? *metrics : compute_metrics(t)); },
        py::arg("timeline"), py::arg("metrics") = py::none(), "SVG Gantt chart text (metrics default: from the events).");
  m.def("ascii_gantt", &ascii_gantt, py::arg("timeline"), py::arg("chars_per_unit") = 2.0, "A plain-text Gantt chart, one line per rank.");
  m.def("write_file", [](const std::string& path, const std::string& contents) { write_file_atomic(path, contents); },
        py::arg("path"), py::arg("contents"), "Writes text to a file atomically.");

  // ---- heap model ----
  py::class_<HeapPeak>(m, "HeapPeak", "One rank's largest predicted heap growth in a step, in its three parts.")
      .def_readonly("activations", &HeapPeak::activations)
      .def_readonly("gradients", &HeapPeak::gradients)
      .def_readonly("transfers", &HeapPeak::transfers)
      .def_property_readonly("total", &HeapPeak::total)
      .def_readonly("position", &HeapPeak::position, "index in the rank's walked list (lowered where transfers carry bytes) after which the peak is reached; -1: none")
      .def_property_readonly("after", [](const HeapPeak& h) { return h.position < 0 ? std::string() : to_string(h.after); })
      .def("__repr__", [](const HeapPeak& h) {
        auto f = [](double v) { return py::repr(py::float_(v)).cast<std::string>(); };
        return "HeapPeak(total=" + f(h.total()) + ", activations=" + f(h.activations) + ", gradients=" + f(h.gradients) +
               ", transfers=" + f(h.transfers) + ", after=" + (h.position < 0 ? std::string("-") : to_string(h.after)) + ")";
      });
  m.def(
      "predict_heap",
      [](const Schedule& s, std::optional<CostModel> costs, bool reference, int receives_ahead, int sends_in_flight) {
        HeapOptions o = reference ? HeapOptions::reference() : HeapOptions{receives_ahead, sends_in_flight};
        return predict_heap(s, costs.value_or(CostModel::uniform(s.stages, StageCost{}, s.virtual_stages_per_rank())), o);
      },
      py::arg("schedule"), py::arg("costs") = py::none(), py::arg("reference") = false, py::arg("receives_ahead") = 4,
      py::arg("sends_in_flight") = 4,
      "Per rank the peak of what a step adds to the heap (activations, weight gradients, transfer buffers). "
      "reference=True: the blocking reference executor (train --reference).");

  // ---- simulation ----
  py::class_<Simulation>(m, "Simulation",
                         "A simulated run: timeline, metrics and the heap model's table. to_dict() is the object "
                         "`pipetrain simulate --json` prints.")
      .def_readonly("schedule", &Simulation::schedule)
      .def_readonly("costs", &Simulation::costs)
      .def_property_readonly("timeline", [](const Simulation& s) { return s.result.timeline; })
      .def_property_readonly("metrics", [](const Simulation& s) { return s.result.metrics; })
      .def_property_readonly("makespan", [](const Simulation& s) { return s.result.metrics.makespan; })
      .def_property_readonly("bubble_fraction", [](const Simulation& s) { return s.result.metrics.bubble_fraction; },
                             "idle share of all ranks over the makespan: 1 - sum_r busy_r / (p * makespan)")
      .def_property_readonly("max_bubble", [](const Simulation& s) { return s.result.metrics.max_bubble(); },
                             "the zero-bubble papers' bubble: max over ranks of span_r - busy_r, in time units")
      .def_property_readonly("max_bubble_fraction", [](const Simulation& s) {
            const Metrics& mm = s.result.metrics;
            return mm.makespan > 0 ? mm.max_bubble() / mm.makespan : 0.0;
          }, "max_bubble / makespan")
      .def_property_readonly("per_stage", [](const Simulation& s) { return s.result.metrics.per_rank; },
                             "per rank: busy, span, bubble, peak_inflight, peak_memory")
      .def_property_readonly("peak_memory", [](const Simulation& s) {
            double peak = 0;
            for (const RankMetrics& r : s.result.metrics.per_rank) peak = std::max(peak, r.peak_memory);
            return peak;
          }, "the largest peak activation memory of any rank, in the cost model's units")
      .def_readonly("heap", &Simulation::heap, "the heap model's per-rank peaks (HeapPeak)")
      .def_property_readonly("heap_policy", [](const Simulation& s) {
            return py::dict(py::arg("receives_ahead") = s.policy.receives_ahead, py::arg("sends_in_flight") = s.policy.sends_in_flight);
          })
      .def("to_dict", [](const Simulation& s) { return to_python(simulation_json(s)); },
           "The object `pipetrain simulate --json` prints.")
      .def("table", &simulation_table, "The table `pipetrain simulate` prints.")
      .def("svg", [](const Simulation& s) { return gantt_svg(s.result.timeline, s.result.metrics); }, "SVG Gantt chart text.")
      .def("chrome_trace", [](const Simulation& s) { return chrome_trace_json(s.result.timeline); }, "Chrome trace JSON text.")
      .def("ascii", [](const Simulation& s, double cpu) { return ascii_gantt(s.result.timeline, cpu); },
           py::arg("chars_per_unit") = 2.0, "A text timeline, one line per rank.")
      .def("write_svg", [](const Simulation& s, const std::string& path) {
             check_output_path(path, "path");
             write_file_atomic(path, gantt_svg(s.result.timeline, s.result.metrics));
           }, py::arg("path"))
      .def("write_trace", [](const Simulation& s, const std::string& path) {
             check_output_path(path, "path");
             write_file_atomic(path, chrome_trace_json(s.result.timeline));
           }, py::arg("path"))
      .def("__repr__", [](const Simulation& s) {
        return "<pipetrain.Simulation " + s.schedule.name + " p=" + std::to_string(s.schedule.ranks) + " makespan=" +
               py::repr(py::float_(s.result.metrics.makespan)).cast<std::string>() + " bubble_fraction=" +
               py::repr(py::float_(s.result.metrics.bubble_fraction)).cast<std::string>() + ">";
      });
  m.def("_simulate", [](const Schedule& s, const CostModel& costs, bool reference) {
          return run_simulation(s, costs, reference ? HeapOptions::reference() : HeapOptions{});
        }, py::arg("schedule"), py::arg("costs"), py::arg("reference"));

  // ---- PyTorch's schedule CSV ----
  py::class_<TorchCsvRead>(m, "TorchCsv", "A PyTorch schedule CSV as read: the schedule, the letters, notes.")
      .def_readonly("schedule", &TorchCsvRead::schedule)
      .def_property_readonly("letters", [](const TorchCsvRead& r) { return std::string(to_string(r.letters)); })
      .def_readonly("with_communication", &TorchCsvRead::with_communication)
      .def_readonly("notes", &TorchCsvRead::notes);
  auto read_opts = [](const std::string& letters, int stages, const std::vector<int>& stage_rank, bool add_steps,
                      const std::string& name) {
    TorchCsvReadOptions o;
    o.letters = parse_torch_letters(letters);
    o.stages = stages;
    o.stage_rank = stage_rank;
    o.add_steps = add_steps;
    o.name = name;
    return o;
  };
  m.def("from_torch_csv", [read_opts](const std::string& text, const std::string& letters, int stages,
                                      const std::vector<int>& stage_rank, bool add_steps, const std::string& name) {
          return from_torch_csv(text, read_opts(letters, stages, stage_rank, add_steps, name));
        },
        py::arg("text"), py::arg("letters") = "detect", py::arg("stages") = 0, py::arg("stage_rank") = std::vector<int>{},
        py::arg("add_steps") = true, py::arg("name") = "torch",
        "Reads PyTorch's schedule CSV (_dump_csv; compute only or with SEND/RECV), current (I, B) or legacy (B, BW) "
        "letters, detected by default. Not validated: call pipetrain.validate(result.schedule).");
  m.def("load_torch_csv", [read_opts](const std::string& path, const std::string& letters, int stages,
                                      const std::vector<int>& stage_rank, bool add_steps, const std::string& name) {
          return load_torch_csv_file(path, read_opts(letters, stages, stage_rank, add_steps, name));
        },
        py::arg("path"), py::arg("letters") = "detect", py::arg("stages") = 0, py::arg("stage_rank") = std::vector<int>{},
        py::arg("add_steps") = true, py::arg("name") = "torch", "from_torch_csv() on a file.");
  m.def("to_torch_csv", [](const Schedule& s, const std::string& letters, bool idle_cells) {
          TorchCsvWriteOptions o;
          o.letters = parse_torch_letters(letters);
          o.idle_cells = idle_cells;
          return to_torch_csv(s, o);
        },
        py::arg("schedule"), py::arg("letters") = "current", py::arg("idle_cells") = true,
        "PyTorch's schedule CSV (pipetrain schedule --format torch): compute only in lock-step columns, or with "
        "SEND/RECV cells for a lowered schedule (what _PipelineScheduleRuntime._load_csv(format='compute_comms') "
        "reads). letters: 'current' (I input gradient, B full backward) or 'legacy' (B, BW).");

  // ---- exact zero bubble ----
  py::class_<ZbExactResult>(m, "ZbExactResult")
      .def_readonly("schedule", &ZbExactResult::schedule)
      .def_readonly("makespan", &ZbExactResult::makespan)
      .def_readonly("lower_bound", &ZbExactResult::lower_bound)
      .def_readonly("proven", &ZbExactResult::proven)
      .def_readonly("nodes", &ZbExactResult::nodes)
      .def_readonly("greedy_makespan", &ZbExactResult::greedy_makespan)
      .def_property_readonly("gap_percent", &ZbExactResult::gap_percent)
      .def("summary", &ZbExactResult::summary);
  m.def("zb_exact", [](int stages, int microbatches, std::optional<CostModel> costs, double memory_limit, long long nodes, int steps) {
          ZbExactOptions o;
          o.memory_limit = memory_limit;
          o.node_budget = nodes;
          o.steps = steps;
          return zb_exact(stages, microbatches, costs.value_or(CostModel::uniform(stages, StageCost{})), o);
        },
        py::arg("stages"), py::arg("microbatches"), py::arg("costs") = py::none(), py::arg("memory_limit") = 0.0,
        py::arg("nodes") = 5000000LL, py::arg("steps") = 1,
        "Exact zero-bubble search (branch and bound, small p*m): the zb-auto schedule with the smallest makespan "
        "under the memory limit (0: p micro-batches), and the greedy's gap.");

  // ---- profiles, balances ----
  m.def("load_profile", [](const std::string& path) { return to_python(profile_to_json(load_profile(path))); },
        py::arg("path"), "Reads a profile (pipetrain's JSON, or PipeDream's graph text) into its JSON form as a dict.");
  m.def("profile", [](py::object obj) { return to_python(profile_to_json(to_profile(obj))); }, py::arg("profile"),
        "Checks a profile (dict, JSON text or path) and returns its JSON form as a dict.");
  m.def("profile_to_json", [](py::object obj) { return profile_to_json_text(to_profile(obj)); }, py::arg("profile"),
        "The profile's JSON text (what save_profile writes).");
  m.def("parse_pipedream_graph", [](const std::string& text, int micro_batch_size, bool planner_states, double opt) {
          PipeDreamOptions o;
          o.micro_batch_size = micro_batch_size;
          o.planner_states = planner_states;
          o.optimizer_bytes_per_parameter_byte = opt;
          return to_python(profile_to_json(parse_pipedream_graph(text, o)));
        },
        py::arg("text"), py::arg("micro_batch_size") = 1, py::arg("planner_states") = false,
        py::arg("optimizer_bytes_per_parameter_byte") = 0.0, "Reads PipeDream's profile text into a profile dict.");
  m.def("balance", [](py::object profile, int stages, const std::string& kind, const std::string& solver) {
          return plan_balance(to_profile(profile), stages, kind, parse_balance_solver(solver));
        },
        py::arg("profile"), py::arg("stages"), py::arg("kind") = "time", py::arg("solver") = "min-max",
        "Layers per stage: kind uniform, parameters, time, memory, type:REGEX or a list such as '3,2,2'; solver "
        "min-max (optimal) or block-partition (torchgpipe's).");
  m.def("balance_costs", [](py::object profile, const std::string& kind) { return balance_costs(to_profile(profile), kind); },
        py::arg("profile"), py::arg("kind") = "time", "The per-layer cost a balance kind evens out.");
  m.def("balance_uniform", &balance_uniform, py::arg("layers"), py::arg("stages"));
  m.def("balance_min_max", &balance_min_max, py::arg("cost"), py::arg("stages"),
        "Optimal contiguous min-max partition of the per-layer costs.");
  m.def("balance_block_partition", &balance_block_partition, py::arg("cost"), py::arg("stages"),
        "torchgpipe's block-partition heuristic.");
  m.def("bottleneck", &bottleneck, py::arg("cost"), py::arg("balance"));
  m.def("check_balance", &check_balance, py::arg("balance"), py::arg("layers"));
  m.def("stage_costs", [](py::object profile, const std::vector<int>& balance, double microbatch_size,
                          std::optional<double> bandwidth, std::optional<double> latency, std::optional<double> overhead) {
          const Profile p = to_profile(profile);
          CostFlags f;
          f.bandwidth = bandwidth;
          f.latency = latency;
          StageCostOptions o;
          o.micro_batch = microbatch_size > 0 ? microbatch_size : p.micro_batch_size;
          std::tie(o.bandwidth_bytes_per_ms, o.latency_ms) = transfer_options(f, p);
          o.overhead_ms = overhead;
          return stage_costs(p, balance, o);
        },
        py::arg("profile"), py::arg("balance"), py::arg("microbatch_size") = 0.0, py::arg("bandwidth") = py::none(),
        py::arg("latency") = py::none(), py::arg("overhead") = py::none(),
        "The cost model of the stages a balance cuts the profile into (ms, bytes). bandwidth in GB/s, latency in us "
        "(default: the profile's measured ones, else free); microbatch_size 0: the profile's.");

  // ---- planners ----
  m.def("plan_pipedream", [](py::object profile, int ranks, double bandwidth, py::object levels, const std::string& cost_form,
                             double memory, bool straight_pipeline, bool allow_fewer_machines,
                             double activation_compression, bool weight_stashing) {
          check_transfer_flags(bandwidth, 0, memory);
          PlannerOptions o;
          o.levels = to_levels(levels);
          if (o.levels.empty()) o.levels.push_back(NetworkLevel{ranks, bandwidth * 1e9});
          o.cost_form = parse_planner_cost_form(cost_form);
          if (memory > 0) o.memory_limit_bytes = memory * 1073741824.0;
          o.straight_pipeline = straight_pipeline;
          o.allow_fewer_machines = allow_fewer_machines;
          o.activation_compression = activation_compression;
          o.weight_stashing = weight_stashing;
          return to_python(plan_to_json(plan_pipedream(to_profile(profile), o)));
        },
        py::arg("profile"), py::arg("ranks") = 2, py::arg("bandwidth") = 10.0, py::arg("levels") = py::none(),
        py::arg("cost_form") = "paper", py::arg("memory") = 0.0, py::arg("straight_pipeline") = false,
        py::arg("allow_fewer_machines") = false, py::arg("activation_compression") = 0.0,
        py::arg("weight_stashing") = false,
        "PipeDream's planner: balance and per-stage replication minimising the bottleneck time. bandwidth in GB/s "
        "(one level of `ranks` devices), or levels innermost first as 'MACHINES:GB/s' strings or (machines, GB/s) "
        "pairs; memory in GiB per device (0: no limit). Returns the plan's JSON form (docs/PROFILE.md) as a dict.");
  m.def("search_plans", [](py::object profile, int ranks, std::optional<double> bandwidth, std::optional<double> latency,
                           double memory, long long batch_size, const std::vector<std::string>& schedules,
                           const std::vector<int>& microbatch_counts, const std::vector<std::string>& balances,
                           const std::string& cost_form, py::object levels, double activation_compression,
                           bool replicated_may_win, bool hybrid, const std::vector<int>& virtual_counts,
                           bool exhaustive) {
          const Profile prof = to_profile(profile);
          if (ranks < 1) throw UsageError("ranks must be >= 1, got " + std::to_string(ranks));
          for (int mm : microbatch_counts)
            if (mm < 1) throw UsageError("microbatch_counts must be >= 1, got " + std::to_string(mm));
          const auto [gbps, us] = plan_transfers(prof, bandwidth, latency);
          if (!std::isinf(gbps)) check_transfer_flags(gbps, us, memory);
          PlanSearchOptions so;
          so.ranks = ranks;
          so.bandwidth_bytes_per_ms = gbps * 1e9 / 1e3;
          so.latency_ms = us / 1e3;
          so.memory_limit_bytes = memory * 1073741824.0;
          so.batch_size = batch_size;
          so.schedules = schedules;
          so.microbatch_counts = microbatch_counts;
          so.balance_kinds = balances;
          so.pipedream.levels = to_levels(levels);
          so.pipedream.cost_form = parse_planner_cost_form(cost_form);
          so.pipedream.activation_compression = activation_compression;
          so.replicated_may_win = replicated_may_win;
          so.hybrid = hybrid;
          so.virtual_counts = virtual_counts;
          so.exhaustive = exhaustive;
          // As `pipetrain plan`: a measured all-reduce prices the replicas on one host unless transfers or
          // levels are given.
          if (!bandwidth && !latency && so.pipedream.levels.empty() && prof.runtime) {
            so.allreduce = prof.runtime->allreduce;
            so.allreduce_ranks = prof.runtime->allreduce_ranks;
          }
          return to_python(search_json(prof, search_plans(prof, so)));
        },
        py::arg("profile"), py::arg("ranks") = 2, py::arg("bandwidth") = py::none(), py::arg("latency") = py::none(),
        py::arg("memory") = 0.0, py::arg("batch_size") = 0,
        py::arg("schedules") = PlanSearchOptions().schedules,
        py::arg("microbatch_counts") = PlanSearchOptions().microbatch_counts,
        py::arg("balances") = PlanSearchOptions().balance_kinds,
        py::arg("cost_form") = "paper", py::arg("levels") = py::none(), py::arg("activation_compression") = 0.0,
        py::arg("replicated_may_win") = true, py::arg("hybrid") = true,
        py::arg("virtual_counts") = PlanSearchOptions().virtual_counts, py::arg("exhaustive") = false,
        "What `pipetrain plan` searches: p stages x d data-parallel copies of the pipeline (p x d <= ranks; p = 1 "
        "is data parallelism) for every schedule (interleaved with each of virtual_counts), micro-batch count and "
        "balance kind x solver, simulated with per-boundary transfers and the copies' all-reduce, pruned exactly by "
        "lower bounds (exhaustive=True: no pruning); PipeDream's planner and its plan as 1F1B-RR are candidates "
        "too, and so is its plan for ranks/d ranks x d copies ('pipedream_copies', one per d tried, each with its "
        "'copies' and the planner's 'plan'). hybrid=False: straight pipelines over min(ranks, layers) ranks only. bandwidth GB/s (default 10, or "
        "the profile's measured), latency us (default 50, or measured), memory GiB per rank (0: no limit), "
        "batch_size 0: max(8, ranks) x the profile's micro-batch. Returns a dict: 'chosen' (never worse than any "
        "entry of 'candidates'), 'best_straight', the baselines, and 'plan_file', what `pipetrain plan --out` "
        "writes (pipetrain train --plan runs it).");
  m.def("umpipe", [](py::object profile, const std::vector<int>& balance, int samples, std::optional<double> bandwidth,
                     std::optional<double> latency, double memory, double overhead, bool rematerialise,
                     const std::string& fit, unsigned long long seed, int generations, const std::string& planner) {
          const Profile prof = to_profile(profile);
          if (generations < 1) throw UsageError("generations must be >= 1, got " + std::to_string(generations));
          if (fit != "table" && fit != "affine") throw UsageError("fit must be table or affine, got " + fit);
          const auto [gbps, us] = plan_transfers(prof, bandwidth, latency);
          UmpipeProfileOptions uo;
          uo.samples = samples;
          uo.bandwidth_bytes_per_s = gbps * 1e9;
          uo.latency_ms = us / 1e3;
          if (memory > 0) uo.memory_limit_bytes = memory * 1073741824.0;
          uo.single_size_overhead_ms = overhead;
          uo.rematerialise = rematerialise;
          uo.fit = fit == "affine" ? UmpipeFit::affine : UmpipeFit::table;
          UmpipeModel um = umpipe_model_from_profile(prof, balance, uo);
          if (uo.rematerialise) um.stages.back().forward = TimeCurve::constant(0);
          DgapOptions dg;
          dg.seed = seed;
          dg.generations = generations;
          std::vector<UmpipeResult> results;
          if (planner == "all") results = plan_umpipe_all(um, dg);
          else if (planner == "equal") results.push_back(plan_umpipe_equal(um));
          else if (planner == "local-greedy") results.push_back(plan_umpipe_local_greedy(um));
          else if (planner == "global-dp") results.push_back(plan_umpipe_global_dp(um));
          else if (planner == "dgap") results.push_back(plan_umpipe_dgap(um, dg));
          else throw UsageError("planner " + planner + " is not one of all, equal, local-greedy, global-dp, dgap");
          py::list out;
          for (const UmpipeResult& r : results) {
            nlohmann::json j = umpipe_result_to_json(r);
            j["microbatches"] = r.microbatches;
            j["generations"] = r.generations;
            j["evaluations"] = r.evaluations;
            out.append(to_python(j));
          }
          return out;
        },
        py::arg("profile"), py::arg("balance"), py::arg("samples"), py::arg("bandwidth") = py::none(),
        py::arg("latency") = py::none(), py::arg("memory") = 0.0, py::arg("overhead") = 0.05,
        py::arg("rematerialise") = true, py::arg("fit") = "table", py::arg("seed") = 1ULL, py::arg("generations") = 800,
        py::arg("planner") = "all",
        "UMPIPE (pipetrain plan --planner umpipe): per stage unequal forward and backward micro-batches of a "
        "mini-batch of `samples`, on the given balance. planner: all (equal, local-greedy, global-dp, dgap), or one "
        "of them. Returns one dict per planner: planner, forward, backward (per stage the sizes), step_ms, ...");
}

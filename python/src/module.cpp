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
#include "pipetrain/core/looped.h"
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

// A field that is a list of bound classes (Schedule.actions, CostModel.stage, ...) is read as a copy:
// def_readwrite/def_readonly hand out each element by reference into the vector, which dangled once the
// list was assigned (a use-after-free from Python) and let `s.actions[0][0].stage = 1` change the
// schedule behind its documented copy.
template <class C, class T>
auto copy_of(T C::*field) {
  return [field](const C& c) { return c.*field; };
}
template <class C, class T>
auto assign_to(T C::*field) {
  return [field](C& c, const T& v) { c.*field = v; };
}

// ---- argument checks ---------------------------------------------------------------------------------
std::string num(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

// A number that must be finite and >= 0 (0 often means "none" or "default"; `zero` says which).
void check_nonneg(const std::string& keyword, double v, const std::string& zero = "") {
  if (!(v >= 0) || !std::isfinite(v))
    throw UsageError(keyword + "=" + num(v) + " must be a finite number >= 0" + (zero.empty() ? "" : " (0: " + zero + ")"));
}
void check_nonneg(const std::string& keyword, const std::optional<double>& v, const std::string& zero = "") {
  if (v) check_nonneg(keyword, *v, zero);
}

// memory_limit: activation memory per rank (0: no limit).
void check_memory_limit(double memory_limit) { check_nonneg("memory_limit", memory_limit, "no limit"); }

// Ctrl-C during a long search (ZbExactOptions::interrupt, every few thousand nodes, with the GIL released
// around the search): a pending SIGINT raises KeyboardInterrupt instead of waiting for the whole budget.
std::function<void()> python_interrupt() {
  return [] {
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  };
}

// A path argument: str or any os.PathLike (pathlib.Path), as os.fspath() gives it.
std::string path_arg(const py::handle& obj, const std::string& keyword) {
  py::object p;
  try {
    p = py::module_::import("os").attr("fspath")(obj);
  } catch (py::error_already_set&) {
    throw py::type_error(keyword + " must be a str or an os.PathLike such as pathlib.Path, got " +
                         py::str(py::type::of(obj).attr("__name__")).cast<std::string>());
  }
  if (py::isinstance<py::bytes>(p)) p = p.attr("decode")();
  const std::string path = p.cast<std::string>();
  if (path.empty()) throw UsageError(keyword + " is empty: give a file path");
  return path;
}

// The structure the writers (to_csv, str, text, rank_line, render_grid) read: one action row per rank,
// stage owners within the ranks. Cheaper and weaker than validate(): an incomplete schedule still prints.
void check_shape(const Schedule& s) {
  auto bad = [&](const std::string& what) {
    throw ScheduleError("inconsistent schedule '" + s.name + "': " + what + " (pipetrain.validate(schedule) checks everything)");
  };
  if (s.ranks < 1) bad("ranks=" + std::to_string(s.ranks) + " must be >= 1");
  if (s.stages < 1) bad("stages=" + std::to_string(s.stages) + " must be >= 1");
  if (static_cast<int>(s.actions.size()) != s.ranks)
    bad("ranks is " + std::to_string(s.ranks) + " but actions has " + std::to_string(s.actions.size()) +
        " rows: give one row of actions per rank (set ranks and actions together)");
  if (static_cast<int>(s.stage_rank.size()) != s.stages)
    bad("stages is " + std::to_string(s.stages) + " but stage_rank has " + std::to_string(s.stage_rank.size()) +
        " entries: give one owner rank per stage");
  for (std::size_t st = 0; st < s.stage_rank.size(); ++st)
    if (s.stage_rank[st] < 0 || s.stage_rank[st] >= s.ranks)
      bad("stage_rank[" + std::to_string(st) + "] is rank " + std::to_string(s.stage_rank[st]) + " but ranks are 0.." +
          std::to_string(s.ranks - 1));
  if (s.replicated() && s.stage_replicas.size() != s.stage_rank.size())
    bad("stage_replicas has " + std::to_string(s.stage_replicas.size()) + " entries for " + std::to_string(s.stages) +
        " stages");
  for (std::size_t st = 0; st < s.stage_replicas.size(); ++st)
    for (int r : s.stage_replicas[st])
      if (r < 0 || r >= s.ranks)
        bad("stage_replicas[" + std::to_string(st) + "] holds rank " + std::to_string(r) + " but ranks are 0.." +
            std::to_string(s.ranks - 1));
}

// What the command line does with every schedule it loads: validate (with the memory limit, 0: none).
// Every binding that consumes a Schedule calls this first; validate() checks the structure before it
// indexes anything, so a malformed schedule raises ScheduleError instead of crashing.
void check_schedule(const Schedule& s, double memory_limit = 0) {
  check_memory_limit(memory_limit);
  ValidateOptions vo;
  if (memory_limit > 0) vo.memory_limit = memory_limit;
  validate(s, vo);
}

// A list argument given as one string (skips="0:3") would be read character by character.
void check_not_str(const py::handle& obj, const std::string& keyword, const std::string& what) {
  if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj))
    throw py::type_error(keyword + " must be a list of " + what + ", got the string " +
                         py::repr(obj).cast<std::string>() + ": wrap it in a list, e.g. [" +
                         py::repr(obj).cast<std::string>() + "]");
}

// ---- JSON <-> Python (through the json module: exact for numbers, strings, lists and dicts) ----------
py::object to_python(const nlohmann::json& j) {
  return py::module_::import("json").attr("loads")(j.dump());
}

// The first NaN or infinite number inside a dict/list, as a path such as layers[0].forward_ms ("" if none).
std::string non_finite_at(const py::handle& obj, const std::string& at) {
  if (py::isinstance<py::float_>(obj)) {
    const double v = obj.cast<double>();
    return std::isfinite(v) ? std::string() : at + " is " + num(v);
  }
  if (py::isinstance<py::dict>(obj)) {
    for (const auto& kv : py::reinterpret_borrow<py::dict>(obj)) {
      const std::string key = py::str(kv.first).cast<std::string>();
      const std::string found = non_finite_at(kv.second, at.empty() ? key : at + "." + key);
      if (!found.empty()) return found;
    }
  } else if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    std::size_t i = 0;
    for (const py::handle& item : obj) {
      const std::string found = non_finite_at(item, at + "[" + std::to_string(i++) + "]");
      if (!found.empty()) return found;
    }
  }
  return "";
}

nlohmann::json from_python(const py::handle& obj, const std::string& what = "profile") {
  const std::string bad = non_finite_at(obj, "");
  if (!bad.empty()) throw UsageError(what + ": " + bad + ": every number must be finite");
  const std::string text = py::module_::import("json").attr("dumps")(obj).cast<std::string>();
  return nlohmann::json::parse(text);
}

// A Python warning (UserWarning); an error when the warnings filter makes it one.
void warn(const std::string& message) {
  if (PyErr_WarnEx(PyExc_UserWarning, message.c_str(), 1) < 0) throw py::error_already_set();
}

// pipedream_batch: the batch size a PipeDream graph file was profiled at (--pipedream-batch); 0: not given.
// kNoPipedreamBatch: the function has no such keyword (its warning points to load_profile's).
constexpr int kNoPipedreamBatch = -1;
void check_pipedream_batch(int pipedream_batch) {
  if (pipedream_batch < 0)
    throw UsageError("pipedream_batch=" + std::to_string(pipedream_batch) + " must be >= 1, the batch size the "
                     "PipeDream graph file was profiled at (VGG-16's: 128), or 0: not given");
}

// A profile file (JSON, or PipeDream's graph text). A PipeDream graph does not record the batch it was
// profiled at: read at 1 without pipedream_batch, its times and activations are that many times off
// (VGG-16's file: 128x), which a warning says, as `pipetrain plan`, `simulate` and `schedule` do.
Profile read_profile_file(const std::string& path, int pipedream_batch) {
  Profile p = load_profile(path);
  const bool graph = p.source.rfind("pipedream graph", 0) == 0;
  if (pipedream_batch > 0) {
    if (!graph)
      throw UsageError("pipedream_batch is for PipeDream graph files; " + path + " is a JSON profile, which records its "
                       "micro-batch size: drop pipedream_batch");
    PipeDreamOptions po;
    po.micro_batch_size = pipedream_batch;
    return load_pipedream_graph(path, po);
  }
  if (graph)
    warn(path + " is a PipeDream graph file, read as profiled at batch size 1 (its format does not record one): " +
         (pipedream_batch == kNoPipedreamBatch
              ? std::string("read it with load_profile(path, pipedream_batch=N) and pass the dict, N")
              : std::string("give pipedream_batch=N")) +
         " being the batch size it was profiled at (VGG-16's: 128), or its times and memory are N times off");
  return p;
}

// A profile given as a dict (the JSON form), JSON text, or a path (JSON or PipeDream's graph text).
Profile to_profile(const py::handle& obj, int pipedream_batch = kNoPipedreamBatch) {
  if (pipedream_batch != kNoPipedreamBatch) check_pipedream_batch(pipedream_batch);
  auto not_a_file = [&](const char* what) {
    if (pipedream_batch > 0)
      throw UsageError(std::string("pipedream_batch is for a PipeDream graph file read from its path; profile is ") +
                       what + ", which gives its micro-batch size: drop pipedream_batch (parse_pipedream_graph(text, "
                       "micro_batch_size=N) reads a graph's text at N)");
  };
  if (py::isinstance<py::dict>(obj)) {
    not_a_file("a dict");
    return profile_from_json(from_python(obj), "profile");
  }
  if (py::isinstance<py::str>(obj)) {
    const std::string text = obj.cast<std::string>();
    const auto first = text.find_first_not_of(" \t\r\n");
    if (first != std::string::npos && text[first] == '{') {
      not_a_file("JSON text");
      return profile_from_json_text(text, "profile");
    }
    return read_profile_file(text, pipedream_batch);
  }
  if (py::hasattr(obj, "__fspath__")) return read_profile_file(path_arg(obj, "profile"), pipedream_batch);
  throw py::type_error("profile must be a dict (the JSON form of docs/PROFILE.md), JSON text or a file path; got " +
                       py::str(py::type::of(obj).attr("__name__")).cast<std::string>());
}
std::optional<Profile> to_profile_opt(const py::object& obj, int pipedream_batch) {
  check_pipedream_batch(pipedream_batch);
  if (obj.is_none()) {
    if (pipedream_batch > 0)
      throw UsageError("pipedream_batch applies with profile= (a PipeDream graph file): add profile=PATH, or drop "
                       "pipedream_batch");
    return std::nullopt;
  }
  return to_profile(obj, pipedream_batch);
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
  std::optional<Profile> profile;  // converted from the Python object before the GIL is released
  std::string balance = "time";
  std::string balance_solver = "min-max";
  double microbatch_size = 0;
  std::optional<double> bandwidth;  // GB/s
  std::optional<double> latency;    // us
  double skip_bandwidth = 0;
};

// The keywords' ranges, checked before anything is built (NaN compares false: every check is !(x >= 0)).
void check_cost_flags(const CostFlags& f) {
  check_nonneg("comm", f.comm);
  check_nonneg("microbatch_size", f.microbatch_size, "the profile's");
  check_nonneg("bandwidth", f.bandwidth, "free transfers; None: the profile's measured, else free");
  check_nonneg("latency", f.latency);
  check_nonneg("skip_bandwidth", f.skip_bandwidth, "unlimited");
}

std::pair<double, double> transfer_options(const CostFlags& f, const Profile& p) {
  check_nonneg("bandwidth", f.bandwidth, "free transfers; None: the profile's measured, else free");
  check_nonneg("latency", f.latency);
  // Each of the two given, or the profile's measured one, or the default (as pipetrain simulate).
  std::pair<double, double> out{f.bandwidth.value_or(0) * 1e6, f.latency.value_or(0) / 1e3};
  if (const auto t = profile_transfers(p)) {
    if (!f.bandwidth) out.first = t->bandwidth_bytes_per_ms;
    if (!f.latency) out.second = t->latency_ms;
  }
  return out;
}

CostModel profile_costs(const CostFlags& f, const Profile& p, int total_stages) {
  check_nonneg("microbatch_size", f.microbatch_size, "the profile's");
  const std::vector<int> b = plan_balance(p, total_stages, f.balance, parse_balance_solver(f.balance_solver));
  StageCostOptions o;
  o.micro_batch = f.microbatch_size > 0 ? f.microbatch_size : p.micro_batch_size;
  std::tie(o.bandwidth_bytes_per_ms, o.latency_ms) = transfer_options(f, p);
  return stage_costs(p, b, o);
}

CostModel flag_costs(const CostFlags& f, const Schedule& s) {
  check_cost_flags(f);
  // As the command line: comm is a transfer's time in cost's units, which a profile's costs do not use.
  if (f.profile && f.comm != 0)
    throw UsageError("comm is a transfer's time in cost's units; with profile= a transfer is priced from "
                     "bandwidth= and latency= (or the profile's measured link), and comm was ignored: drop comm=, "
                     "or give bandwidth=/latency=");
  CostModel c;
  if (f.profile) {
    const Profile& p = *f.profile;
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
  check_memory_limit(memory_limit);
  check_cost_flags(cf);
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
  refuse_looped_without_loops(name, virtual_stages, "virtual");  // as the command line
  GeneratorOptions o;
  o.ranks = stages;
  o.microbatches = microbatches;
  o.virtual_stages = virtual_stages;
  o.steps = steps;
  o.memory_limit = memory_limit;
  if (name == "zb-h2" || name == "zb-auto") {
    if (stages < 1) throw UsageError("stages must be >= 1, got " + std::to_string(stages));
    if (cf.profile) {
      o.costs = profile_costs(cf, *cf.profile, stages * virtual_stages);
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
    zo.interrupt = python_interrupt();
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
  std::optional<ZbExactResult> exact;  // simulate('zb-auto', exact=True): the search's result
};

Simulation run_simulation(const Schedule& s, const CostModel& costs, const HeapOptions& policy,
                          const std::optional<ZbExactResult>& exact = std::nullopt) {
  Simulation out;
  out.exact = exact;
  out.schedule = s;
  out.costs = costs;
  out.result = simulate(s, costs);
  out.heap = predict_heap(s, costs, policy);
  out.policy = policy;
  return out;
}

// The object `pipetrain simulate --json` prints, key for key (core/simulate_json.h).
nlohmann::json simulation_json(const Simulation& sim) {
  nlohmann::json j = pipetrain::simulation_json(sim.schedule, sim.result, sim.heap, sim.policy);
  if (const auto& f = sim.exact)  // as apps/pipetrain/cmd_simulate.cpp adds it
    j["exact"] = {{"greedy_makespan", f->greedy_makespan}, {"makespan", f->makespan},
                  {"gap_percent", f->gap_percent()},        {"proven", f->proven},
                  {"lower_bound", f->lower_bound},          {"nodes", f->nodes}};
  return j;
}

// ascii_gantt with its argument checked: the line width is makespan x chars_per_unit characters.
std::string checked_ascii(const Timeline& t, double cpu) {
  if (!(cpu > 0) || !std::isfinite(cpu))
    throw UsageError("chars_per_unit=" + num(cpu) + " must be a finite number > 0 (characters per time unit), e.g. 2");
  double t0 = 0, t1 = 0;
  bool any = false;
  for (const TimedAction& e : t.events) {
    t0 = any ? std::min(t0, e.start) : e.start;
    t1 = any ? std::max(t1, e.end) : e.end;
    any = true;
  }
  const double width = (t1 - t0) * cpu;
  if (!(width <= 1e6))
    throw UsageError("chars_per_unit=" + num(cpu) + " makes lines of " + num(width) + " characters (the timeline spans " +
                     num(t1 - t0) + " time units): give chars_per_unit <= " + num(1e6 / std::max(t1 - t0, 1e-300)));
  return ascii_gantt(t, cpu);
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
  check_not_str(levels, "levels", "'MACHINES:GB/s' strings or (machines, GB/s) pairs");
  const std::string form = "a level is 'MACHINES:GB/s' or (MACHINES, GB/s) with a whole MACHINES >= 1 and a finite GB/s > 0, "
                           "e.g. '4:100' or (4, 100.0)";
  std::size_t i = 0;
  for (const py::handle& item : levels) {
    const std::string at = "levels[" + std::to_string(i++) + "]=" + py::repr(item).cast<std::string>();
    double machines = 0, gbps = 0;
    if (py::isinstance<py::str>(item)) {
      const std::string lv = item.cast<std::string>();
      const auto colon = lv.find(':');
      try {
        if (colon == std::string::npos) throw std::invalid_argument(lv);
        std::size_t used = 0;
        const std::string m_text = lv.substr(0, colon), g_text = lv.substr(colon + 1);
        machines = std::stod(m_text, &used);
        if (used != m_text.size()) throw std::invalid_argument(lv);
        gbps = std::stod(g_text, &used);
        if (used != g_text.size()) throw std::invalid_argument(lv);
      } catch (const std::exception&) {
        throw UsageError(at + ": " + form);
      }
    } else {
      if (!py::isinstance<py::sequence>(item) || py::len(item) != 2) throw py::type_error(at + ": " + form);
      const py::sequence pair = py::reinterpret_borrow<py::sequence>(item);
      try {
        machines = py::float_(pair[0]).cast<double>();
        gbps = py::float_(pair[1]).cast<double>();
      } catch (py::error_already_set&) {
        throw py::type_error(at + ": " + form);
      }
    }
    if (!(machines >= 1) || machines != std::floor(machines) || machines > 1e9 || !(gbps > 0) || !std::isfinite(gbps))
      throw UsageError(at + ": " + form);
    out.push_back(NetworkLevel{static_cast<int>(machines), gbps * 1e9});
  }
  return out;
}

// The levels describe the devices a plan is placed on: they must be the ranks planned for (search_plans
// refuses the same in the core, in the command line's words).
void check_levels_ranks(const std::vector<NetworkLevel>& levels, int ranks) {
  if (levels.empty() || planner_devices(levels) == ranks) return;
  std::string product;
  for (const NetworkLevel& l : levels) product += (product.empty() ? "" : " x ") + std::to_string(l.machines);
  throw UsageError("levels describe " + product + " = " + std::to_string(planner_devices(levels)) +
                   " devices but ranks is " + std::to_string(ranks) + ": give ranks=" +
                   std::to_string(planner_devices(levels)) + " (the product of the levels' MACHINES), leave ranks out, "
                   "or give levels whose MACHINES multiply to " + std::to_string(ranks));
}

// A link's GB/s for the planners: > 0, infinity allowed (free transfers), NaN not.
void check_link_bandwidth(const std::optional<double>& gbps) {
  if (gbps && !(*gbps > 0))
    throw UsageError("bandwidth=" + num(*gbps) + " must be a number of GB/s > 0 (float('inf'): free transfers)");
}

void check_activation_compression(double c) { check_nonneg("activation_compression", c, "none"); }

void check_transfer_flags(double bandwidth_gbps, double latency_us, double memory_gib) {
  if (!(bandwidth_gbps > 0)) throw UsageError("bandwidth must be > 0 GB/s, got " + std::to_string(bandwidth_gbps));
  if (!std::isfinite(bandwidth_gbps))
    throw UsageError("bandwidth must be a finite number of GB/s, got " + std::to_string(bandwidth_gbps));
  if (latency_us < 0) throw UsageError("latency must be >= 0 us, got " + std::to_string(latency_us));
  if (memory_gib < 0) throw UsageError("memory must be >= 0 GiB, got " + std::to_string(memory_gib));
}

// The transfers `pipetrain plan` plans with: each given, or a measured profile's, or the default.
std::pair<double, double> plan_transfers(const Profile& prof, std::optional<double> bandwidth, std::optional<double> latency) {
  double gbps = bandwidth.value_or(10.0), us = latency.value_or(50.0);
  if (const auto t = profile_transfers(prof)) {
    if (!bandwidth) gbps = t->bandwidth_bytes_per_ms / 1e6;
    if (!latency) us = t->latency_ms * 1e3;
  }
  return {gbps, us};
}

// ---- pickling (py::pickle; copy.deepcopy goes through it too) ----------------------------------------
py::tuple action_state(const Action& a) {
  return py::make_tuple(std::string(kind_name(a.kind)), a.stage, a.index, a.paired, a.peer);
}
Action action_from_state(const py::tuple& t) {
  if (t.size() != 5) throw std::runtime_error("Action: bad pickled state");
  Action a;
  a.kind = parse_kind(t[0].cast<std::string>());
  a.stage = t[1].cast<int>();
  a.index = t[2].cast<int>();
  a.paired = t[3].cast<bool>();
  a.peer = t[4].cast<int>();
  return a;
}
py::tuple stage_cost_state(const StageCost& c) {
  return py::make_tuple(c.f, c.b, c.w, c.activation, c.gradient_b, c.gradient_w, c.message, c.w_held);
}
StageCost stage_cost_from_state(const py::tuple& t) {
  if (t.size() != 8) throw std::runtime_error("StageCost: bad pickled state");
  return StageCost{t[0].cast<double>(), t[1].cast<double>(), t[2].cast<double>(), t[3].cast<double>(),
                   t[4].cast<double>(), t[5].cast<double>(), t[6].cast<double>(), t[7].cast<double>()};
}
py::tuple cost_model_state(const CostModel& c) {
  py::list stages;
  for (const StageCost& s : c.stage) stages.append(stage_cost_state(s));
  return py::make_tuple(stages, c.comm, c.boundary_comm, c.step, c.bandwidth, c.stage_step, c.b_release_fraction,
                        c.overhead);
}
CostModel cost_model_from_state(const py::tuple& t) {
  if (t.size() != 8) throw std::runtime_error("CostModel: bad pickled state");
  CostModel c;
  for (const py::handle& s : t[0]) c.stage.push_back(stage_cost_from_state(py::reinterpret_borrow<py::tuple>(s)));
  c.comm = t[1].cast<double>();
  c.boundary_comm = t[2].cast<std::vector<double>>();
  c.step = t[3].cast<double>();
  c.bandwidth = t[4].cast<double>();
  c.stage_step = t[5].cast<std::vector<double>>();
  c.b_release_fraction = t[6].cast<double>();
  c.overhead = t[7].cast<double>();
  return c;
}
py::tuple schedule_state(const Schedule& s) {
  py::list rows;
  for (const auto& row : s.actions) {
    py::list r;
    for (const Action& a : row) r.append(action_state(a));
    rows.append(r);
  }
  py::list skips;
  for (const SkipEdge& k : s.skips) skips.append(py::make_tuple(k.from_stage, k.to_stage, k.size));
  return py::make_tuple(s.name, s.ranks, s.stages, s.microbatches, s.microbatches_per_step, s.synchronous,
                        s.stage_rank, s.stage_replicas, rows, skips);
}
Schedule schedule_from_state(const py::tuple& t) {
  if (t.size() != 10) throw std::runtime_error("Schedule: bad pickled state");
  Schedule s;
  s.name = t[0].cast<std::string>();
  s.ranks = t[1].cast<int>();
  s.stages = t[2].cast<int>();
  s.microbatches = t[3].cast<int>();
  s.microbatches_per_step = t[4].cast<int>();
  if (s.ranks < 1 || s.microbatches_per_step < 1)  // as the setters refuse them (they divide)
    throw UsageError("Schedule: pickled ranks=" + std::to_string(s.ranks) + " and microbatches_per_step=" +
                     std::to_string(s.microbatches_per_step) + " must be >= 1");
  s.synchronous = t[5].cast<bool>();
  s.stage_rank = t[6].cast<std::vector<int>>();
  s.stage_replicas = t[7].cast<std::vector<std::vector<int>>>();
  for (const py::handle& row : t[8]) {
    std::vector<Action> r;
    for (const py::handle& a : row) r.push_back(action_from_state(py::reinterpret_borrow<py::tuple>(a)));
    s.actions.push_back(std::move(r));
  }
  for (const py::handle& k : t[9]) {
    const auto e = k.cast<std::tuple<int, int, double>>();
    s.skips.push_back(SkipEdge{std::get<0>(e), std::get<1>(e), std::get<2>(e)});
  }
  return s;
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
             if (stage < 0) throw UsageError("Action stage=" + std::to_string(stage) + " must be >= 0");
             if (index < 0) throw UsageError("Action index=" + std::to_string(index) + " must be >= 0 (a micro-batch, or the step for 'S')");
             if (peer < -1) throw UsageError("Action peer=" + std::to_string(peer) + " must be >= 0, or -1 (the neighbouring stage)");
             Action a;
             a.kind = parse_kind(kind);
             a.stage = stage;
             a.index = index;
             a.paired = paired;
             a.peer = peer;
             return a;
           }),
           py::arg("kind"), py::arg("stage"), py::arg("index"), py::arg("paired") = false, py::arg("peer") = -1,
           "stage and index must be >= 0 (validate() checks them against a schedule's sizes); peer >= -1.")
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
      .def("__hash__", [](const Action& a) { return std::hash<Action>{}(a); })
      .def(py::pickle(&action_state, &action_from_state));

  py::class_<SkipEdge>(m, "SkipEdge", "A skip connection: from_stage stashes a tensor of `size` that to_stage pops.")
      .def(py::init([](int from, int to, double size) { return SkipEdge{from, to, size}; }), py::arg("from_stage"),
           py::arg("to_stage"), py::arg("size") = 1.0)
      .def_readwrite("from_stage", &SkipEdge::from_stage)
      .def_readwrite("to_stage", &SkipEdge::to_stage)
      .def_readwrite("size", &SkipEdge::size)
      .def("__repr__", [](const SkipEdge& k) {
        return "SkipEdge(" + std::to_string(k.from_stage) + ", " + std::to_string(k.to_stage) + ", " + py::repr(py::float_(k.size)).cast<std::string>() + ")";
      })
      .def(py::self == py::self)
      .def(py::pickle([](const SkipEdge& k) { return py::make_tuple(k.from_stage, k.to_stage, k.size); },
                      [](const py::tuple& t) {
                        if (t.size() != 3) throw std::runtime_error("SkipEdge: bad pickled state");
                        return SkipEdge{t[0].cast<int>(), t[1].cast<int>(), t[2].cast<double>()};
                      }));

  py::class_<Schedule>(m, "Schedule", py::dynamic_attr(),
                       "Per rank, the ordered list of actions it runs (actions[r]). Made by pipetrain.schedule(), "
                       "Schedule.from_csv() or pipetrain.from_torch_csv(); str() gives one line per rank.")
      .def(py::init<>())
      .def_property(
          "built_with",
          [](py::object self) -> py::object {
            py::dict d = self.attr("__dict__");
            return d.contains("_built_with") ? py::object(d["_built_with"]) : py::object(py::none());
          },
          [](py::object self, py::object value) { self.attr("__dict__")["_built_with"] = value; },
          "The keyword arguments pipetrain.schedule() built it with (a dict: name, stages, ..., cost, profile, ..., and "
          "exact_result after exact=True), or None for a Schedule made otherwise. simulate() and costs() take their "
          "cost keywords from it when not given. Copies and pickles keep it.")
      .def_readwrite("name", &Schedule::name)
      // ranks and microbatches_per_step divide (virtual_stages, steps, repr): below 1 they are refused here,
      // where a 0 ended the interpreter with SIGFPE at the next repr.
      .def_property("ranks", [](const Schedule& s) { return s.ranks; },
                    [](Schedule& s, int v) {
                      if (v < 1) throw UsageError("Schedule.ranks=" + std::to_string(v) + " must be >= 1 (p, the ranks)");
                      s.ranks = v;
                    }, "p: ranks (devices, processes), >= 1")
      .def_readwrite("stages", &Schedule::stages, "S: (virtual) stages, p * v for the looped and V schedules")
      .def_readwrite("microbatches", &Schedule::microbatches, "micro-batches over all steps")
      .def_property("microbatches_per_step", [](const Schedule& s) { return s.microbatches_per_step; },
                    [](Schedule& s, int v) {
                      if (v < 1)
                        throw UsageError("Schedule.microbatches_per_step=" + std::to_string(v) +
                                         " must be >= 1 (m, the micro-batches of one optimizer step)");
                      s.microbatches_per_step = v;
                    }, "m: micro-batches per optimizer step, >= 1")
      .def_readwrite("synchronous", &Schedule::synchronous, "flushes at every optimizer step")
      .def_readwrite("stage_rank", &Schedule::stage_rank, "stage_rank[s]: the rank that owns stage s")
      .def_readwrite("stage_replicas", &Schedule::stage_replicas, "per stage its replicas' ranks (1F1B-RR); [] if none")
      .def_property("actions", copy_of(&Schedule::actions), assign_to(&Schedule::actions),
                     "actions[r]: rank r's actions in order (a copy: assign a whole list to change it)")
      .def_property("skips", copy_of(&Schedule::skips), assign_to(&Schedule::skips), "skip routes (a copy)")
      // Checked here too: a pickled state (or a copy) does not pass through the setters above.
      .def_property_readonly("steps", [](const Schedule& s) {
             if (s.microbatches_per_step < 1)
               throw UsageError("Schedule.microbatches_per_step=" + std::to_string(s.microbatches_per_step) +
                                " must be >= 1");
             return s.steps();
           }, "optimizer steps")
      .def_property_readonly("virtual_stages", [](const Schedule& s) {
             if (s.ranks < 1) throw UsageError("Schedule.ranks=" + std::to_string(s.ranks) + " must be >= 1");
             return s.virtual_stages_per_rank();
           }, "stages per rank")
      .def("rank_of", [](const Schedule& s, int stage) {
             if (stage < 0 || stage >= static_cast<int>(s.stage_rank.size()))
               throw py::index_error("rank_of(stage=" + std::to_string(stage) + "): the schedule's stages are 0.." +
                                     std::to_string(static_cast<int>(s.stage_rank.size()) - 1));
             return s.rank_of(stage);
           }, py::arg("stage"), "The rank that owns a stage (0..stages-1; IndexError outside).")
      .def("rank_line", [](const Schedule& s, int r) {
             check_shape(s);
             if (r < 0 || r >= s.ranks) throw py::index_error("rank " + std::to_string(r) + " of " + std::to_string(s.ranks));
             return rank_line(s, r);
           }, py::arg("rank"), "Rank r's actions as one line of text, one cell per word.")
      .def("text", [](const Schedule& s) {
             check_shape(s);
             std::string out;
             for (const SkipEdge& k : s.skips)
               out += "skip " + std::to_string(k.from_stage) + " -> " + std::to_string(k.to_stage) + " size " +
                      py::str(py::float_(k.size)).cast<std::string>() + "\n";
             for (int r = 0; r < s.ranks; ++r) out += "rank " + std::to_string(r) + ": " + rank_line(s, r) + "\n";
             return out;
           }, "The text `pipetrain schedule` prints: one line 'rank r: ...' per rank.")
      .def("to_csv", [](const Schedule& s) { check_shape(s); return to_csv(s); },
           "pipetrain's CSV form (pipetrain schedule --format csv). Not validated (an incomplete schedule prints), "
           "but an inconsistent one (rows != ranks, owners outside the ranks) raises ScheduleError.")
      .def_static("from_csv", &from_csv, py::arg("text"),
                  "Parses pipetrain's CSV form. Not validated here; every function that runs it validates it.")
      .def_static("load_csv", [](py::object path) { return load_csv_file(path_arg(path, "path")); }, py::arg("path"),
                  "Reads pipetrain's CSV form from a file (str or os.PathLike).")
      .def("__str__", [](const Schedule& s) {
        check_shape(s);
        std::string out;
        for (int r = 0; r < s.ranks; ++r) out += "rank " + std::to_string(r) + ": " + rank_line(s, r) + "\n";
        return out;
      })
      .def("__repr__", [](const Schedule& s) {
        return "<pipetrain.Schedule " + s.name + " p=" + std::to_string(s.ranks) + " stages=" + std::to_string(s.stages) +
               " m=" + std::to_string(s.microbatches_per_step) + " steps=" +
               (s.microbatches_per_step >= 1 ? std::to_string(s.steps()) : std::string("?")) + ">";
      })
      .def(py::self == py::self)
      // Copies and pickles carry the instance's attributes (built_with) along with the schedule.
      .def("__copy__", [](py::object self) {
        py::object c = py::cast(Schedule(self.cast<const Schedule&>()));
        c.attr("__dict__").attr("update")(self.attr("__dict__"));
        return c;
      })
      .def("__deepcopy__", [](py::object self, py::dict memo) {
        py::object c = py::cast(Schedule(self.cast<const Schedule&>()));
        c.attr("__dict__").attr("update")(py::module_::import("copy").attr("deepcopy")(self.attr("__dict__"), memo));
        return c;
      }, py::arg("memo"))
      .def(py::pickle(
          [](py::object self) { return py::make_tuple(schedule_state(self.cast<const Schedule&>()), self.attr("__dict__")); },
          [](const py::tuple& t) {
            if (t.size() == 2)  // (state, __dict__)
              return std::make_pair(schedule_from_state(t[0].cast<py::tuple>()), t[1].cast<py::dict>());
            return std::make_pair(schedule_from_state(t), py::dict());  // pickled before built_with
          }));

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
  m.def("stages_per_rank", [](const std::string& name, int v) {
          if (v < 1) throw UsageError("virtual=" + std::to_string(v) + " must be >= 1 (stages per rank of the looped schedules)");
          return stages_per_rank(name, v);
        }, py::arg("name"), py::arg("virtual") = 1, "Stages each rank holds under the schedule `name` with virtual stages per rank.");

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
      })
      .def(py::pickle(&stage_cost_state, &stage_cost_from_state));

  py::class_<CostModel>(m, "CostModel",
                        "Per-stage times and memory, transfer and step times: what the simulator reads. `stage` is a "
                        "copy: assign a whole list to change it.")
      .def(py::init([](std::vector<StageCost> stage, double comm, double step, double bandwidth,
                       std::vector<double> stage_step, double b_release_fraction, double overhead,
                       std::vector<double> boundary_comm) {
             CostModel c;
             c.stage = std::move(stage);
             c.comm = comm;
             c.boundary_comm = std::move(boundary_comm);
             c.step = step;
             c.bandwidth = bandwidth;
             c.stage_step = std::move(stage_step);
             c.b_release_fraction = b_release_fraction;
             c.overhead = overhead;
             return c;
           }),
           py::arg("stage") = std::vector<StageCost>{}, py::arg("comm") = 0.0, py::arg("step") = 0.0,
           py::arg("bandwidth") = 0.0, py::arg("stage_step") = std::vector<double>{},
           py::arg("b_release_fraction") = 0.5, py::arg("overhead") = 0.0,
           py::arg("boundary_comm") = std::vector<double>{})
      .def_static("uniform", [](int stages, StageCost per_stage, int virtual_per_rank, double comm) {
                    if (stages < 1) throw UsageError("CostModel.uniform: stages=" + std::to_string(stages) + " must be >= 1");
                    if (virtual_per_rank < 1)
                      throw UsageError("CostModel.uniform: virtual_per_rank=" + std::to_string(virtual_per_rank) + " must be >= 1");
                    check_nonneg("comm", comm);
                    return CostModel::uniform(stages, per_stage, virtual_per_rank, comm);
                  }, py::arg("stages"), py::arg("per_stage") = StageCost{},
                  py::arg("virtual_per_rank") = 1, py::arg("comm") = 0.0,
                  "Every stage costs per_stage, split evenly over virtual_per_rank chunks.")
      .def_property("stage", copy_of(&CostModel::stage), assign_to(&CostModel::stage),
                    "per stage its StageCost (a copy: assign a whole list to change it)")
      .def_readwrite("comm", &CostModel::comm, "time of one transfer between ranks")
      .def_readwrite("boundary_comm", &CostModel::boundary_comm,
                     "per stage boundary (stages - 1 entries): the time of one transfer across it, as stage_costs "
                     "and the plan search price each cut by its own bytes; empty: every transfer costs comm")
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
      })
      .def(py::pickle(&cost_model_state, &cost_model_from_state));
  m.def("parse_stage_costs", &parse_stage_costs, py::arg("text"),
        "Parses 'F:B:W' (all stages) or 'F:B:W,F:B:W,...' (one per stage), as --cost.");

  m.def(
      "_costs",
      [](Schedule s, const std::string& cost, double comm, py::object profile, const std::string& balance,
         const std::string& balance_solver, double microbatch_size, std::optional<double> bandwidth,
         std::optional<double> latency, double skip_bandwidth, int pipedream_batch, bool checked) {
        if (!checked) check_schedule(s);
        CostFlags f{cost, comm, to_profile_opt(profile, pipedream_batch), balance, balance_solver, microbatch_size,
                    bandwidth, latency, skip_bandwidth};
        py::gil_scoped_release nogil;
        return flag_costs(f, s);
      },
      py::arg("schedule"), py::arg("cost"), py::arg("comm"), py::arg("profile"), py::arg("balance"),
      py::arg("balance_solver"), py::arg("microbatch_size"), py::arg("bandwidth"), py::arg("latency"),
      py::arg("skip_bandwidth"), py::arg("pipedream_batch") = 0, py::arg("checked") = false);

  m.def(
      "_schedule",
      [](const std::string& name, int stages, int microbatches, int virtual_stages, int steps, double memory_limit,
         const std::vector<int>& replication, const std::vector<std::string>& skips, bool exact, long long exact_nodes,
         const std::string& cost, double comm, py::object profile, const std::string& balance,
         const std::string& balance_solver, double microbatch_size, std::optional<double> bandwidth,
         std::optional<double> latency, int pipedream_batch) {
        CostFlags f{cost, comm, to_profile_opt(profile, pipedream_batch), balance, balance_solver, microbatch_size,
                    bandwidth, latency, 0.0};
        ZbExactResult found;
        Schedule s;
        {
          py::gil_scoped_release nogil;
          s = make_schedule(name, stages, microbatches, virtual_stages, steps, memory_limit, replication, skips, exact,
                            exact_nodes, f, exact ? &found : nullptr);
        }
        py::object result = py::none();
        if (exact) result = py::cast(found);
        return py::make_tuple(s, result);
      },
      py::arg("name"), py::arg("stages"), py::arg("microbatches"), py::arg("virtual"), py::arg("steps"),
      py::arg("memory_limit"), py::arg("replication"), py::arg("skips"), py::arg("exact"), py::arg("exact_nodes"),
      py::arg("cost"), py::arg("comm"), py::arg("profile"), py::arg("balance"), py::arg("balance_solver"),
      py::arg("microbatch_size"), py::arg("bandwidth"), py::arg("latency"), py::arg("pipedream_batch") = 0);

  // What the command line does with --load FILE: the skip routes added (to a copy), then validated with
  // the memory limit.
  m.def(
      "_prepare",
      [](Schedule s, double memory_limit, const std::vector<std::string>& skips) {
        py::gil_scoped_release nogil;
        check_memory_limit(memory_limit);
        if (!skips.empty() && !s.skips.empty())
          throw UsageError("the schedule already declares skip routes (schedule.skips): drop skips=");
        add_skips(s, skips);
        check_schedule(s, memory_limit);
        return s;
      },
      py::arg("schedule"), py::arg("memory_limit"), py::arg("skips"));

  // ---- validation and lowering ----
  m.def(
      "validate",
      [](Schedule s, double memory_limit, std::optional<CostModel> costs) {
        check_memory_limit(memory_limit);
        ValidateOptions vo = validate_options(memory_limit);
        if (costs) vo.costs = *costs;
        py::gil_scoped_release nogil;
        try {
          validate(s, vo);
        } catch (const ScheduleError& e) {
          // The core's message counts in micro-batches; with costs the unit is the costs' activation unit.
          std::string what = e.what();
          const std::string mb = " micro-batches of activations";
          if (costs && what.find(mb) != std::string::npos)
            what.replace(what.find(mb), mb.size(), " of activations (the costs' activation unit, e.g. bytes)");
          throw ScheduleError(what);
        }
      },
      py::arg("schedule"), py::arg("memory_limit") = 0.0, py::arg("costs") = py::none(),
      "Checks sizes, completeness, order, deadlock freedom and (memory_limit > 0) activation memory per rank. "
      "memory_limit is in micro-batches (one micro-batch of a whole stage = 1) without costs, and in the unit of "
      "the costs' `activation` with costs (bytes for stage_costs() of a profile); 0: no limit. Raises "
      "pipetrain.ScheduleError (a ValueError) whose message carries the step x rank grid with the offending cell "
      "marked.");
  m.def("render_grid", [](Schedule s, const std::vector<std::pair<int, int>>& marked) {
          s.ranks = static_cast<int>(s.actions.size());  // the rows there are (a malformed schedule's ranks may differ)
          std::vector<GridCell> cells;
          for (const auto& [r, p] : marked) {
            if (r < 0 || r >= s.ranks || p < 0 || p >= static_cast<int>(s.actions[static_cast<std::size_t>(r)].size()))
              throw UsageError("render_grid: marked cell (" + std::to_string(r) + ", " + std::to_string(p) +
                               ") is not in the schedule: give (rank, position) with rank 0.." + std::to_string(s.ranks - 1) +
                               " and position below that rank's number of actions");
            cells.push_back(GridCell{r, p});
          }
          return render_grid(s, cells);
        }, py::arg("schedule"), py::arg("marked") = std::vector<std::pair<int, int>>{},
        "The step x rank grid of the action rows there are (also of an invalid schedule), marking the (rank, "
        "position) cells given; a marked cell outside the rows raises ValueError.");
  m.def("lower", [](Schedule s, std::optional<CostModel> costs) {  // copies: another thread may change the object
          py::gil_scoped_release nogil;
          check_schedule(s);
          return insert_communication(s, costs.value_or(CostModel{}));
        },
        py::arg("schedule"), py::arg("costs") = py::none(),
        "Inserts the send and receive actions (pipetrain schedule --lower), in an order that cannot deadlock on "
        "blocking transports. costs (default: F = B = W = 1) only decide how early transfers are posted.");
  m.def("strip_communication", [](Schedule s) {
          py::gil_scoped_release nogil;
          check_schedule(s);
          return strip_communication(s);
        }, py::arg("schedule"), "The inverse of lower().");

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
      })
      .def(py::pickle(
          [](const TimedAction& e) { return py::make_tuple(e.rank, action_state(e.action), e.start, e.end); },
          [](const py::tuple& t) {
            if (t.size() != 4) throw std::runtime_error("TimedAction: bad pickled state");
            return TimedAction{t[0].cast<int>(), action_from_state(t[1].cast<py::tuple>()), t[2].cast<double>(),
                               t[3].cast<double>()};
          }));
  py::class_<Timeline>(m, "Timeline", "When each action ran on each rank (simulated or measured).")
      .def(py::init<>())
      .def_readwrite("schedule", &Timeline::schedule)
      .def_readwrite("ranks", &Timeline::ranks)
      .def_readwrite("microbatches", &Timeline::microbatches)
      .def_readwrite("total_microbatches", &Timeline::total_microbatches)
      .def_readwrite("virtual_stages", &Timeline::virtual_stages)
      .def_readwrite("unit", &Timeline::unit)
      .def_property("events", copy_of(&Timeline::events), assign_to(&Timeline::events), "list of TimedAction (a copy)")
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
      .def("__len__", [](const Timeline& t) { return t.events.size(); })
      .def(py::pickle(
          [](const Timeline& t) {
            py::list events;
            for (const TimedAction& e : t.events) events.append(py::make_tuple(e.rank, action_state(e.action), e.start, e.end));
            return py::make_tuple(t.schedule, t.ranks, t.microbatches, t.total_microbatches, t.virtual_stages, t.unit,
                                  events);
          },
          [](const py::tuple& t) {
            if (t.size() != 7) throw std::runtime_error("Timeline: bad pickled state");
            Timeline out;
            out.schedule = t[0].cast<std::string>();
            out.ranks = t[1].cast<int>();
            out.microbatches = t[2].cast<int>();
            out.total_microbatches = t[3].cast<int>();
            out.virtual_stages = t[4].cast<int>();
            out.unit = t[5].cast<std::string>();
            for (const py::handle& e : t[6]) {
              const py::tuple x = py::reinterpret_borrow<py::tuple>(e);
              out.events.push_back(TimedAction{x[0].cast<int>(), action_from_state(x[1].cast<py::tuple>()),
                                               x[2].cast<double>(), x[3].cast<double>()});
            }
            return out;
          }));
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
      .def_property_readonly("per_rank", copy_of(&Metrics::per_rank), "per rank its RankMetrics (a copy)")
      .def_property_readonly("max_bubble", &Metrics::max_bubble, "max over ranks of span - busy (zero-bubble papers)");
  m.def("compute_metrics", &compute_metrics, py::arg("timeline"), "Busy, span, bubble and makespan from the events alone.");
  m.def("chrome_trace_json", &chrome_trace_json, py::arg("timeline"), "Chrome trace JSON text (Perfetto, chrome://tracing).");
  m.def("gantt_svg", [](const Timeline& t, std::optional<Metrics> metrics) { return gantt_svg(t, metrics ? *metrics : compute_metrics(t)); },
        py::arg("timeline"), py::arg("metrics") = py::none(), "SVG Gantt chart text (metrics default: from the events).");
  m.def("ascii_gantt", [](const Timeline& t, double cpu) { return checked_ascii(t, cpu); }, py::arg("timeline"),
        py::arg("chars_per_unit") = 2.0,
        "A plain-text Gantt chart, one line per rank (chars_per_unit > 0; lines of at most 1e6 characters).");
  m.def("write_file", [](py::object path, const std::string& contents) {
          const std::string p = path_arg(path, "path");
          check_output_path(p, "path");
          write_file_atomic(p, contents);
        },
        py::arg("path"), py::arg("contents"), "Writes text to a file atomically (path: str or os.PathLike).");

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
      [](Schedule s, std::optional<CostModel> costs, bool reference, int receives_ahead, int sends_in_flight) {
        if (receives_ahead < 0) throw UsageError("receives_ahead=" + std::to_string(receives_ahead) + " must be >= 0");
        if (sends_in_flight < 0) throw UsageError("sends_in_flight=" + std::to_string(sends_in_flight) + " must be >= 0");
        HeapOptions o = reference ? HeapOptions::reference() : HeapOptions{receives_ahead, sends_in_flight};
        py::gil_scoped_release nogil;
        check_schedule(s);
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
      .def_property_readonly("heap", copy_of(&Simulation::heap), "the heap model's per-rank peaks (HeapPeak, a copy)")
      .def_property_readonly("heap_policy", [](const Simulation& s) {
            return py::dict(py::arg("receives_ahead") = s.policy.receives_ahead, py::arg("sends_in_flight") = s.policy.sends_in_flight);
          })
      .def_readonly("exact", &Simulation::exact,
                    "simulate('zb-auto', exact=True): the search's ZbExactResult (greedy_makespan, gap_percent, ...); "
                    "else None")
      .def("to_dict", [](const Simulation& s) { return to_python(simulation_json(s)); },
           "The object `pipetrain simulate --json` prints (with 'exact' after an exact search).")
      .def("table", &simulation_table, "The table `pipetrain simulate` prints.")
      .def("svg", [](const Simulation& s) { return gantt_svg(s.result.timeline, s.result.metrics); }, "SVG Gantt chart text.")
      .def("chrome_trace", [](const Simulation& s) { return chrome_trace_json(s.result.timeline); }, "Chrome trace JSON text.")
      .def("ascii", [](const Simulation& s, double cpu) { return checked_ascii(s.result.timeline, cpu); },
           py::arg("chars_per_unit") = 2.0,
           "A text timeline, one line per rank (chars_per_unit > 0; lines of at most 1e6 characters).")
      .def("write_svg", [](const Simulation& s, py::object path) {
             const std::string p = path_arg(path, "path");
             check_output_path(p, "path");
             write_file_atomic(p, gantt_svg(s.result.timeline, s.result.metrics));
           }, py::arg("path"), "Writes the SVG Gantt chart (path: str or os.PathLike).")
      .def("write_trace", [](const Simulation& s, py::object path) {
             const std::string p = path_arg(path, "path");
             check_output_path(p, "path");
             write_file_atomic(p, chrome_trace_json(s.result.timeline));
           }, py::arg("path"), "Writes the Chrome trace (path: str or os.PathLike).")
      .def(py::pickle(
          [](const Simulation& s) {  // the inputs: unpickling simulates again (deterministic)
            return py::make_tuple(schedule_state(s.schedule), cost_model_state(s.costs), s.policy.receives_ahead,
                                  s.policy.sends_in_flight, s.exact ? py::cast(*s.exact) : py::object(py::none()));
          },
          [](const py::tuple& t) {
            if (t.size() != 5) throw std::runtime_error("Simulation: bad pickled state");
            const Schedule s = schedule_from_state(t[0].cast<py::tuple>());
            const CostModel c = cost_model_from_state(t[1].cast<py::tuple>());
            const HeapOptions policy{t[2].cast<int>(), t[3].cast<int>()};
            std::optional<ZbExactResult> exact;
            if (!t[4].is_none()) exact = t[4].cast<ZbExactResult>();
            py::gil_scoped_release nogil;
            check_schedule(s);  // a pickle is data like any other
            return run_simulation(s, c, policy, exact);
          }))
      .def("__repr__", [](const Simulation& s) {
        return "<pipetrain.Simulation " + s.schedule.name + " p=" + std::to_string(s.schedule.ranks) + " makespan=" +
               py::repr(py::float_(s.result.metrics.makespan)).cast<std::string>() + " bubble_fraction=" +
               py::repr(py::float_(s.result.metrics.bubble_fraction)).cast<std::string>() + ">";
      });
  // checked=True: the caller validated the schedule already (schedule() and _prepare() do).
  m.def("_simulate", [](Schedule s, CostModel costs, bool reference, std::optional<ZbExactResult> exact,
                        bool checked) {
          py::gil_scoped_release nogil;
          if (!checked) check_schedule(s);
          return run_simulation(s, costs, reference ? HeapOptions::reference() : HeapOptions{}, exact);
        }, py::arg("schedule"), py::arg("costs"), py::arg("reference"), py::arg("exact") = py::none(),
        py::arg("checked") = false);

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
  m.def("load_torch_csv", [read_opts](py::object path, const std::string& letters, int stages,
                                      const std::vector<int>& stage_rank, bool add_steps, const std::string& name) {
          return load_torch_csv_file(path_arg(path, "path"), read_opts(letters, stages, stage_rank, add_steps, name));
        },
        py::arg("path"), py::arg("letters") = "detect", py::arg("stages") = 0, py::arg("stage_rank") = std::vector<int>{},
        py::arg("add_steps") = true, py::arg("name") = "torch", "from_torch_csv() on a file (str or os.PathLike).");
  m.def("to_torch_csv", [](const Schedule& s, const std::string& letters, bool idle_cells) {
          check_schedule(s);
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
      .def("summary", &ZbExactResult::summary)
      .def(py::pickle(
          [](const ZbExactResult& r) {
            return py::make_tuple(schedule_state(r.schedule), r.makespan, r.lower_bound, r.proven, r.nodes,
                                  r.greedy_makespan);
          },
          [](const py::tuple& t) {
            if (t.size() != 6) throw std::runtime_error("ZbExactResult: bad pickled state");
            ZbExactResult r;
            r.schedule = schedule_from_state(t[0].cast<py::tuple>());
            r.makespan = t[1].cast<double>();
            r.lower_bound = t[2].cast<double>();
            r.proven = t[3].cast<bool>();
            r.nodes = t[4].cast<long long>();
            r.greedy_makespan = t[5].cast<double>();
            return r;
          }));
  m.def("zb_exact", [](int stages, int microbatches, std::optional<CostModel> costs, double memory_limit, long long nodes, int steps) {
          check_memory_limit(memory_limit);
          if (stages < 1) throw UsageError("stages=" + std::to_string(stages) + " must be >= 1");
          ZbExactOptions o;
          o.memory_limit = memory_limit;
          o.node_budget = nodes;
          o.steps = steps;
          o.interrupt = python_interrupt();
          py::gil_scoped_release nogil;
          return zb_exact(stages, microbatches, costs.value_or(CostModel::uniform(stages, StageCost{})), o);
        },
        py::arg("stages"), py::arg("microbatches"), py::arg("costs") = py::none(), py::arg("memory_limit") = 0.0,
        py::arg("nodes") = 5000000LL, py::arg("steps") = 1,
        "Exact zero-bubble search (branch and bound, small p*m): the zb-auto schedule with the smallest makespan "
        "under the memory limit (0: p micro-batches), and the greedy's gap.");

  // ---- profiles, balances ----
  m.def("load_profile", [](py::object path, int pipedream_batch) {
          check_pipedream_batch(pipedream_batch);
          return to_python(profile_to_json(read_profile_file(path_arg(path, "path"), pipedream_batch)));
        },
        py::arg("path"), py::kw_only(), py::arg("pipedream_batch") = 0,
        "Reads a profile (pipetrain's JSON, or PipeDream's graph text) into its JSON form as a dict. pipedream_batch: "
        "the batch size a PipeDream graph file was profiled at (--pipedream-batch; its format does not record it, "
        "VGG-16's is 128); without it a graph is read at 1, with a warning.");
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
          check_nonneg("microbatch_size", microbatch_size, "the profile's");
          check_nonneg("overhead", overhead);
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
  m.def("plan_pipedream", [](py::object profile, std::optional<int> ranks_given, double bandwidth, py::object levels,
                             const std::string& cost_form, double memory, bool straight_pipeline,
                             bool allow_fewer_machines, double activation_compression, bool weight_stashing,
                             int pipedream_batch) {
          check_transfer_flags(bandwidth, 0, memory);
          check_nonneg("memory", memory, "no limit");
          check_activation_compression(activation_compression);
          PlannerOptions o;
          o.levels = to_levels(levels);
          const int ranks = ranks_given ? *ranks_given : o.levels.empty() ? 2 : planner_devices(o.levels);
          if (ranks < 1) throw UsageError("ranks=" + std::to_string(ranks) + " must be >= 1");
          check_levels_ranks(o.levels, ranks);
          if (o.levels.empty()) o.levels.push_back(NetworkLevel{ranks, bandwidth * 1e9});
          o.cost_form = parse_planner_cost_form(cost_form);
          if (memory > 0) o.memory_limit_bytes = memory * 1073741824.0;
          o.straight_pipeline = straight_pipeline;
          o.allow_fewer_machines = allow_fewer_machines;
          o.activation_compression = activation_compression;
          o.weight_stashing = weight_stashing;
          const Profile prof = to_profile(profile, pipedream_batch);
          nlohmann::json j;
          {
            py::gil_scoped_release nogil;
            j = plan_to_json(plan_pipedream(prof, o));
          }
          return to_python(j);
        },
        py::arg("profile"), py::arg("ranks") = py::none(), py::arg("bandwidth") = 10.0, py::arg("levels") = py::none(),
        py::arg("cost_form") = "paper", py::arg("memory") = 0.0, py::arg("straight_pipeline") = false,
        py::arg("allow_fewer_machines") = false, py::arg("activation_compression") = 0.0,
        py::arg("weight_stashing") = false, py::arg("pipedream_batch") = 0,
        "PipeDream's planner: balance and per-stage replication minimising the bottleneck time. bandwidth in GB/s "
        "(one level of `ranks` devices, default 2), or levels innermost first (their MACHINES multiply to ranks; "
        "ranks left out: that product) as 'MACHINES:GB/s' strings or (machines, GB/s) "
        "pairs; memory in GiB per device (0: no limit); pipedream_batch: the batch size a PipeDream graph file was "
        "profiled at (--pipedream-batch). Returns the plan's JSON form (docs/PROFILE.md) as a dict.");
  m.def("search_plans", [](py::object profile, int ranks, std::optional<double> bandwidth, std::optional<double> latency,
                           double memory, long long batch_size, const std::vector<std::string>& schedules,
                           const std::vector<int>& microbatch_counts, const std::vector<std::string>& balances,
                           const std::string& cost_form, py::object levels, double activation_compression,
                           bool replicated_may_win, bool hybrid, const std::vector<int>& virtual_counts,
                           bool exhaustive, int pipedream_batch) {
          const Profile prof = to_profile(profile, pipedream_batch);
          if (ranks < 1) throw UsageError("ranks must be >= 1, got " + std::to_string(ranks));
          if (batch_size < 0)
            throw UsageError("batch_size=" + std::to_string(batch_size) + " must be >= 0 samples (0: max(8, ranks) x the "
                             "profile's micro-batch)");
          check_link_bandwidth(bandwidth);
          check_nonneg("latency", latency);
          check_nonneg("memory", memory, "no limit");
          check_activation_compression(activation_compression);
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
          // As `pipetrain plan`: the asynchronous schedules are not searched; a warning names them when others
          // are given (only those: the search refuses, saying so).
          {
            std::string given_async, async_names;
            bool any_sync = false;
            for (const std::string& name : schedules) {
              const bool sync = schedule_traits(name).synchronous;
              any_sync |= sync;
              if (!sync) given_async += (given_async.empty() ? "" : ", ") + name;
            }
            for (const std::string& name : schedule_names())
              if (!schedule_traits(name).synchronous) async_names += (async_names.empty() ? "" : ", ") + name;
            if (any_sync && !given_async.empty())
              warn("search_plans: schedules " + given_async + " left out: the asynchronous schedules (" + async_names +
                   ") are not searched (they never flush, so no step time compares with the others'); PipeDream's own "
                   "planner is run for every plan (the result's 'pipedream' and 'replicated')");
          }
          so.microbatch_counts = microbatch_counts;
          so.balance_kinds = balances;
          so.pipedream.levels = to_levels(levels);
          check_levels_ranks(so.pipedream.levels, ranks);
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
          nlohmann::json j;
          {
            py::gil_scoped_release nogil;
            j = search_json(prof, search_plans(prof, so));
          }
          return to_python(j);
        },
        py::arg("profile"), py::arg("ranks") = 2, py::arg("bandwidth") = py::none(), py::arg("latency") = py::none(),
        py::arg("memory") = 0.0, py::arg("batch_size") = 0,
        py::arg("schedules") = PlanSearchOptions().schedules,
        py::arg("microbatch_counts") = PlanSearchOptions().microbatch_counts,
        py::arg("balances") = PlanSearchOptions().balance_kinds,
        py::arg("cost_form") = "paper", py::arg("levels") = py::none(), py::arg("activation_compression") = 0.0,
        py::arg("replicated_may_win") = true, py::arg("hybrid") = true,
        py::arg("virtual_counts") = PlanSearchOptions().virtual_counts, py::arg("exhaustive") = false,
        py::arg("pipedream_batch") = 0,
        "What `pipetrain plan` searches: p stages x d data-parallel copies of the pipeline (p x d <= ranks; p = 1 "
        "is data parallelism) for every schedule (interleaved with each of virtual_counts), micro-batch count and "
        "balance kind x solver, simulated with per-boundary transfers and the copies' all-reduce, pruned exactly by "
        "lower bounds (exhaustive=True: no pruning); PipeDream's planner and its plan as 1F1B-RR are candidates "
        "too, and so is its plan for ranks/d ranks x d copies ('pipedream_copies', one per d tried, each with its "
        "'copies' and the planner's 'plan'). hybrid=False: straight pipelines over min(ranks, layers) ranks only. bandwidth GB/s (default 10, or "
        "the profile's measured), latency us (default 50, or measured), memory GiB per rank (0: no limit), "
        "batch_size 0: max(8, ranks) x the profile's micro-batch; pipedream_batch: the batch size a PipeDream graph "
        "file was profiled at (--pipedream-batch; without it a graph is read at 1, with a warning). The asynchronous "
        "schedules (pipedream, 2bw, spectrain) are not searched (a warning names them). Returns a dict: 'chosen' (never worse than any "
        "entry of 'candidates'), 'best_straight', the baselines, and 'plan_file', what `pipetrain plan --out` "
        "writes (pipetrain train --plan runs it).");
  m.def("umpipe", [](py::object profile, const std::vector<int>& balance, int samples, std::optional<double> bandwidth,
                     std::optional<double> latency, double memory, double overhead, bool rematerialise,
                     const std::string& fit, unsigned long long seed, int generations, const std::string& planner,
                     int pipedream_batch) {
          const Profile prof = to_profile(profile, pipedream_batch);
          if (generations < 1) throw UsageError("generations must be >= 1, got " + std::to_string(generations));
          if (fit != "table" && fit != "affine") throw UsageError("fit must be table or affine, got " + fit);
          if (samples < 1) throw UsageError("samples=" + std::to_string(samples) + " must be >= 1 (the mini-batch)");
          check_link_bandwidth(bandwidth);
          check_nonneg("latency", latency);
          check_nonneg("memory", memory, "no limit");
          check_nonneg("overhead", overhead);
          const auto [gbps, us] = plan_transfers(prof, bandwidth, latency);
          UmpipeProfileOptions uo;
          uo.samples = samples;
          uo.bandwidth_bytes_per_s = gbps * 1e9;
          uo.latency_ms = us / 1e3;
          if (memory > 0) uo.memory_limit_bytes = memory * 1073741824.0;
          uo.single_size_overhead_ms = overhead;
          uo.rematerialise = rematerialise;
          uo.fit = fit == "affine" ? UmpipeFit::affine : UmpipeFit::table;
          if (planner != "all" && planner != "equal" && planner != "local-greedy" && planner != "global-dp" && planner != "dgap")
            throw UsageError("planner " + planner + " is not one of all, equal, local-greedy, global-dp, dgap");
          DgapOptions dg;
          dg.seed = seed;
          dg.generations = generations;
          std::vector<UmpipeResult> results;
          py::gil_scoped_release nogil;
          UmpipeModel um = umpipe_model_from_profile(prof, balance, uo);
          if (uo.rematerialise) um.stages.back().forward = TimeCurve::constant(0);
          if (planner == "all") results = plan_umpipe_all(um, dg);
          else if (planner == "equal") results.push_back(plan_umpipe_equal(um));
          else if (planner == "local-greedy") results.push_back(plan_umpipe_local_greedy(um));
          else if (planner == "global-dp") results.push_back(plan_umpipe_global_dp(um));
          else if (planner == "dgap") results.push_back(plan_umpipe_dgap(um, dg));
          py::gil_scoped_acquire gil;
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
        py::arg("planner") = "all", py::arg("pipedream_batch") = 0,
        "UMPIPE (pipetrain plan --planner umpipe): per stage unequal forward and backward micro-batches of a "
        "mini-batch of `samples`, on the given balance. planner: all (equal, local-greedy, global-dp, dgap), or one "
        "of them. pipedream_batch: the batch size a PipeDream graph file was profiled at (--pipedream-batch). Returns "
        "one dict per planner: planner, forward, backward (per stage the sizes), step_ms, ...");
}

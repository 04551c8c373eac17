#include "cli_common.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <tuple>

#include "pipetrain/core/config.h"
#include "pipetrain/core/looped.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/core/read_file.h"
#include "pipetrain/plan/balance.h"
#include "pipetrain/plan/costs.h"
#include "pipetrain/plan/profile.h"
#include "pipetrain/core/skip.h"
#include "pipetrain/core/torch_csv.h"
#include "pipetrain/core/validate.h"

namespace pipetrain::cli {

bool ScheduleFlags::given(const char* flag) const {
  const CLI::Option* o = app ? app->get_option_no_throw(flag) : nullptr;
  return o && o->count() > 0;
}

void ScheduleFlags::add_to(CLI::App& app) {
  this->app = &app;
  std::string names;
  for (const auto& n : schedule_names()) names += (names.empty() ? "" : ", ") + n;
  app.add_option("--schedule,-s", schedule, "schedule to generate: " + names);
  app.add_option("--load", load, "read the schedule from a CSV file (one row per rank) instead");
  stages_option = app.add_option("--stages,-p", stages, "number of pipeline stages (ranks), >= 1");
  microbatches_option = app.add_option("--microbatches,-m", microbatches, "micro-batches per optimizer step, >= 1");
  app.add_option("--virtual,-v", virtual_stages, "virtual stages per rank: 2 or more for interleaved, interleaved-zb and looped-bfs (which need it); 1 otherwise");
  app.add_option("--steps", steps, "optimizer steps to lay out back to back, default 1");
  app.add_option("--replication", replication,
                 "replicas per stage, e.g. 3,1: PipeDream's 1F1B-RR, micro-batches round robin over a stage's replicas "
                 "(gpipe or 1f1b; one rank per replica)")
      ->delimiter(',');
  app.add_option("--cost", cost,
                 "per-micro-batch times F:B:W (forward, input-gradient backward, weight-gradient backward): one "
                 "triple for every rank, or a comma-separated list of one per rank, each split evenly over the "
                 "rank's stages when it holds several (--virtual, V schedules: the same model cut finer), or one "
                 "per stage (p x v triples, each that stage's own); default 1:1:1");
  app.add_option("--comm", comm, "time of one transfer between ranks, default 0");
  app.add_option("--profile", profile,
                 "take stage costs from a profile (pipetrain profile JSON or PipeDream graph text) instead of --cost");
  app.add_option("--balance", balance,
                 "with --profile: uniform, parameters, time (default), memory, type:REGEX or layer counts 3,2,2");
  app.add_option("--balance-solver", balance_solver, "with --profile: min-max (default) or block-partition");
  pipedream_batch_option = app.add_option("--pipedream-batch", pipedream_batch,
                 "with --profile of a PipeDream graph file: the batch it was profiled at (its format does not record "
                 "it; VGG-16's: 128)");
  app.add_option("--microbatch-size", microbatch_size, "with --profile: samples per micro-batch; default the profile's");
  bandwidth_option = app.add_option("--bandwidth", bandwidth_gbps,
                                    "with --profile: GB/s between ranks; default: the profile's measured bandwidth, "
                                    "else transfers cost the latency only");
  latency_option = app.add_option("--latency", latency_us,
                                  "with --profile: microseconds per transfer; default: the profile's measured latency, "
                                  "else 0");
  app.add_option("--skip", skips,
                 "FROM:TO[:SIZE], repeatable: a skip connection from stage FROM straight to stage TO >= FROM + 2, "
                 "SIZE per micro-batch in activation units (default 1); lowering, validation and the simulator "
                 "add its transfers, time and memory");
  app.add_option("--skip-bandwidth", skip_bandwidth,
                 "activation units per time unit a skip transfer moves: a skip costs --comm + SIZE / this; "
                 "default 0, unlimited");
  app.add_option("--memory-limit", memory_limit,
                 "activation memory limit per rank, in micro-batches: checked for every schedule, and the "
                 "target of zb-auto (default for zb-auto: p)");
}

void ScheduleFlags::refuse_profile_flags_without_profile() const {
  if (!profile.empty()) return;
  // Each of these is read only where the costs come from a profile (profile_costs, transfer_options,
  // load_profile_flags); --cost and --comm runs never look at them.
  const std::pair<const char*, const char*> flags[] = {
      {"--balance", "cuts a profile's layers into stages"},
      {"--balance-solver", "chooses how --balance cuts a profile's layers"},
      {"--microbatch-size", "scales a profile's times and activations to that many samples"},
      {"--pipedream-batch", "gives the batch a PipeDream graph file was profiled at"},
      {"--bandwidth", "prices a profile's activation transfers"},
      {"--latency", "prices a profile's activation transfers"},
  };
  for (const auto& [flag, what] : flags)
    if (given(flag))
      throw UsageError(std::string(flag) + " applies with --profile (it " + what + "), and none is given: the costs "
                       "come from --cost and --comm here (a transfer costs --comm): add --profile FILE, or drop " + flag);
}

namespace {

// `p` with links and dots resolved as far as it exists (lexically where it cannot be resolved).
std::filesystem::path resolved(const std::filesystem::path& p) {
  std::error_code ec;
  const std::filesystem::path abs = std::filesystem::absolute(p, ec);
  if (ec) return p.lexically_normal();
  const std::filesystem::path r = std::filesystem::weakly_canonical(abs, ec);
  return ec ? abs.lexically_normal() : r;
}

}  // namespace

bool same_path(const std::filesystem::path& a, const std::filesystem::path& b) {
  std::error_code ec;
  if (std::filesystem::equivalent(a, b, ec) && !ec) return true;
  return resolved(a) == resolved(b);
}

bool inside(const std::filesystem::path& p, const std::filesystem::path& dir) {
  const auto d = resolved(dir);
  for (auto q = resolved(p); !q.empty(); q = q.parent_path()) {
    if (q == d) return true;
    if (q == q.parent_path()) break;
  }
  return false;
}

void refuse_empty_names(const CLI::App* cmd, std::initializer_list<const char*> flags) {
  for (const char* flag : flags) {
    const CLI::Option* o = cmd->get_option_no_throw(flag);
    if (o && o->count() > 0 && o->as<std::string>().empty())
      throw UsageError(std::string(flag) + " was given an empty name (an unset shell variable?): give a path, or "
                       "drop " + flag);
  }
}

void check_outputs_apart(const std::vector<std::pair<const char*, std::string>>& outputs,
                         const std::vector<std::pair<const char*, std::string>>& inputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const auto& [flag, path] = outputs[i];
    if (path.empty() || path.rfind("/dev/", 0) == 0) continue;  // /dev/stdout, /dev/null: not files of the run's
    for (std::size_t k = i + 1; k < outputs.size(); ++k)
      if (!outputs[k].second.empty() && same_path(path, outputs[k].second))
        throw UsageError(std::string(flag) + " and " + outputs[k].first + " both write " + path +
                         ": one would replace the other; give each its own file");
    for (const auto& [in_flag, in_path] : inputs)
      if (!in_path.empty() && same_path(path, in_path))
        throw UsageError(std::string(flag) + " " + path + " is the file " + in_flag + " reads: writing it would "
                         "replace it; write " + flag + " elsewhere");
  }
}

// --load FILE --format torch: PyTorch's schedule CSV, validated as a generated schedule is.
Schedule ScheduleFlags::load_torch(const std::string& letters, const std::vector<int>& stage_rank,
                                   std::vector<std::string>& notes) const {
  if (load.empty())
    throw UsageError("PyTorch's format reads the file given by --load: add --load FILE.csv (a schedule PyTorch dumped "
                     "with _dump_csv)");
  if (!schedule.empty())
    throw UsageError("give either --schedule " + schedule + " or --load " + load + ", not both");
  refuse_profile_flags_without_profile();
  if (!replication.empty())
    throw UsageError("--replication applies to a generated schedule; PyTorch's schedule CSV gives every stage one rank");
  TorchCsvReadOptions o;
  o.letters = parse_torch_letters(letters);
  o.stage_rank = stage_rank;
  o.stages = static_cast<int>(stage_rank.size());
  TorchCsvRead r = load_torch_csv_file(load, o);
  // The file gives its own sizes; --stages and --microbatches, when given, must agree with them.
  if (stages_option && stages_option->count() > 0 && stages != r.schedule.ranks)
    throw UsageError("--stages " + std::to_string(stages) + " but " + load + " has " +
                     std::to_string(r.schedule.ranks) + " rows (ranks): drop --stages, the file gives it");
  if (microbatches_option && microbatches_option->count() > 0 &&
      microbatches != r.schedule.microbatches)
    throw UsageError("--microbatches " + std::to_string(microbatches) + " but " + load + " has " +
                     std::to_string(r.schedule.microbatches) + " micro-batches: drop --microbatches, the file gives it");
  // PyTorch's CSV holds one step, and its stages per rank give --virtual.
  const std::pair<const char*, std::pair<int, int>> sizes[] = {
      {"--steps", {steps, r.schedule.steps()}}, {"--virtual", {virtual_stages, r.schedule.virtual_stages_per_rank()}}};
  for (const auto& [flag, v] : sizes)
    if (given(flag) && v.first != v.second)
      throw UsageError(std::string(flag) + " " + std::to_string(v.first) + " but " + load + " has " +
                       std::to_string(v.second) + ": drop " + flag + ", the file gives it");
  ValidateOptions vo;
  if (memory_limit > 0) vo.memory_limit = memory_limit;
  add_skips(r.schedule);
  validate(r.schedule, vo);
  notes = std::move(r.notes);
  notes.push_back(std::string("read with PyTorch's ") + to_string(r.letters) + " letters, " +
                  (r.with_communication ? "with communication" : "compute only") + "; " +
                  std::to_string(r.schedule.stages) + " stages on " + std::to_string(r.schedule.ranks) + " ranks");
  return std::move(r.schedule);
}

Schedule ScheduleFlags::build() const {
  // Values that read as "not given" and flags that did nothing, which ran without a word.
  refuse_profile_flags_without_profile();
  if (memory_limit < 0)
    throw UsageError("--memory-limit must be >= 0 (0: no limit; for zb-auto, p micro-batches), got " +
                     std::to_string(memory_limit));
  if (given("--microbatch-size") && !(microbatch_size > 0))
    throw UsageError("--microbatch-size must be > 0 (or not given: the profile's), got " + std::to_string(microbatch_size));
  if (!profile.empty() && given("--cost"))
    throw UsageError("--cost and --profile both give the stages' costs (--profile's were used): drop one");
  if (!profile.empty() && given("--comm"))
    throw UsageError("--comm is a transfer's time in --cost's units; with --profile a transfer is priced from "
                     "--bandwidth and --latency (or the profile's measured link), and --comm was ignored: drop "
                     "--comm, or give --bandwidth/--latency");
  Schedule s;
  if (!load.empty()) {
    if (!replication.empty())
      throw UsageError("--replication applies to a generated schedule, not --load " + load +
                       ": a CSV file gives its replicas in its header (stage_replicas=0/1:2)");
    if (!schedule.empty())
      throw UsageError("give either --schedule " + schedule + " or --load " + load + ", not both");
    s = load_csv_file(load);
    // The file gives its own sizes; flags that would generate them must agree (they were ignored).
    const std::pair<const char*, std::pair<int, int>> sizes[] = {{"--stages", {stages, s.ranks}},
                                                                  {"--microbatches", {microbatches, s.microbatches_per_step}},
                                                                  {"--steps", {steps, s.steps()}},
                                                                  {"--virtual", {virtual_stages, s.virtual_stages_per_rank()}}};
    for (const auto& [flag, v] : sizes)
      if (given(flag) && v.first != v.second)
        throw UsageError(std::string(flag) + " " + std::to_string(v.first) + " but " + load + " has " +
                         std::to_string(v.second) + ": drop " + flag + ", the file gives it");
  } else {
    if (schedule.empty()) {
      std::string names;
      for (const auto& n : schedule_names()) names += (names.empty() ? "" : ", ") + n;
      throw UsageError("missing --schedule: choose one of " + names + ", or --load FILE.csv");
    }
    if (!replication.empty()) {
      if (stages_option && stages_option->count() > 0 && stages != static_cast<int>(replication.size()))
        throw UsageError("--replication lists " + std::to_string(replication.size()) + " stages but --stages is " +
                         std::to_string(stages) + ": give one replica count per stage (or drop --stages)");
      if (microbatches_option && microbatches_option->count() == 0)
        throw UsageError("missing --microbatches M (micro-batches per step, >= 1)");
      if (virtual_stages != 1) throw UsageError("--replication runs without virtual stages: drop --virtual");
      s = round_robin(schedule, replication, microbatches, steps);
      add_skips(s);
      ValidateOptions vo;
      if (memory_limit > 0) vo.memory_limit = memory_limit;
      validate(s, vo);
      return s;
    }
    if (stages_option && stages_option->count() == 0)
      throw UsageError("missing --stages P (the number of pipeline stages, >= 1)");
    if (microbatches_option && microbatches_option->count() == 0)
      throw UsageError("missing --microbatches M (micro-batches per step, >= 1)");
    // Without --virtual a looped schedule was the unlooped one under its name (interleaved = 1f1b's
    // actions, looped-bfs = gpipe's), which a researcher comparing schedules took for a result; train refuses it.
    refuse_looped_without_loops(schedule, virtual_stages, "--virtual", given("--virtual") ? "" : " (not given)");
    GeneratorOptions o;
    o.ranks = stages;
    o.microbatches = microbatches;
    o.virtual_stages = virtual_stages;
    o.steps = steps;
    o.memory_limit = memory_limit;
    if ((schedule == "zb-h2" || schedule == "zb-auto") && !profile.empty()) {
      if (stages < 1) throw UsageError("--stages must be >= 1, got " + std::to_string(stages));
      o.costs = profile_costs(stages * virtual_stages, stages);
    } else if (schedule == "zb-h2" || schedule == "zb-auto") {
      if (stages < 1) throw UsageError("--stages must be >= 1, got " + std::to_string(stages));
      o.costs.stage = parse_stage_costs(cost);
      o.costs.comm = comm;
      if (o.costs.stage.size() != 1 && static_cast<int>(o.costs.stage.size()) != stages)
        throw UsageError("--cost lists " + std::to_string(o.costs.stage.size()) + " stages but --stages is " +
                         std::to_string(stages) + ": give one F:B:W triple, or one per stage");
    }
    s = generate(schedule, o);
  }
  add_skips(s);
  ValidateOptions vo;
  if (memory_limit > 0) vo.memory_limit = memory_limit;
  validate(s, vo);
  return s;
}

void ScheduleFlags::add_skips(Schedule& s) const {
  if (skips.empty() && s.skips.empty() && given("--skip-bandwidth"))
    throw UsageError("--skip-bandwidth prices skip transfers, and this schedule has no skip routes: add --skip "
                     "FROM:TO[:SIZE], or drop --skip-bandwidth");
  if (skips.empty()) return;
  if (!s.skips.empty())
    throw UsageError("--load " + load + " already declares skip routes (skips= in its header): drop --skip");
  for (const std::string& text : skips) s.skips.push_back(parse_skip_route(text));
  try {
    check_skip_routes(s);
  } catch (const UsageError& e) {
    throw UsageError(std::string("--skip: ") + e.what());
  }
}

Profile ScheduleFlags::load_profile_flags() const {
  if (pipedream_batch < 0 || (pipedream_batch == 0 && pipedream_batch_option && pipedream_batch_option->count() > 0))
    throw UsageError("--pipedream-batch must be >= 1 (the batch size the PipeDream graph was profiled at, e.g. 128), got " +
                     std::to_string(pipedream_batch));
  Profile p = load_profile(profile);
  // A PipeDream graph file does not record the batch it was profiled at: read at 1, its times and
  // activations are that many times off (VGG-16's file: 128x), as `pipetrain plan` warns too.
  if (pipedream_batch == 0 && p.source.rfind("pipedream graph", 0) == 0 && !pipedream_warned) {
    pipedream_warned = true;
    std::cerr << "pipetrain " << (app ? app->get_name() : std::string("simulate")) << ": warning: " << profile
              << " is a PipeDream graph file, read as profiled at batch size 1 (its format does not record one): "
              << "give --pipedream-batch N, the batch size it was profiled at (VGG-16's: 128), or its times and "
              << "memory are N times off\n";
  }
  if (pipedream_batch > 0) {
    if (p.source.rfind("pipedream graph", 0) != 0)
      throw UsageError("--pipedream-batch is for PipeDream graph files; " + profile +
                       " is a JSON profile, which records its micro-batch size: drop --pipedream-batch");
    PipeDreamOptions po;
    po.micro_batch_size = pipedream_batch;
    p = load_pipedream_graph(profile, po);
  }
  return p;
}

std::pair<double, double> ScheduleFlags::transfer_options(const Profile& p) const {
  if (bandwidth_gbps < 0 || latency_us < 0) throw UsageError("--bandwidth and --latency must be >= 0");
  // Each of the two from its flag when given, else from the profile's measured transfers when it has them
  // (--latency alone keeps the measured bandwidth, as --bandwidth's help says), else the flag's default.
  std::pair<double, double> out{bandwidth_gbps * 1e6, latency_us / 1e3};
  if (const auto t = profile_transfers(p)) {
    if (!(bandwidth_option && bandwidth_option->count() > 0)) out.first = t->bandwidth_bytes_per_ms;
    if (!(latency_option && latency_option->count() > 0)) out.second = t->latency_ms;
  }
  return out;
}

CostModel ScheduleFlags::profile_costs(int total_stages, int ranks) const {
  const Profile p = load_profile_flags();
  if (microbatch_size < 0) throw UsageError("--microbatch-size must be > 0");
  const int layers = static_cast<int>(p.layers.size());
  if (ranks > 0 && total_stages > ranks && total_stages > layers) {
    // Several stages per rank (--virtual, or a V schedule's two): the balancer's own "use --stages <= L"
    // names the total, which --stages does not set.
    const int per_rank = (total_stages + ranks - 1) / ranks;
    throw UsageError(std::to_string(total_stages) + " stages (" + std::to_string(per_rank) + " on each of the " +
                     std::to_string(ranks) + " ranks) but the profile has " + std::to_string(layers) + " layers: " +
                     (layers / per_rank >= 1 ? "use --stages <= " + std::to_string(layers / per_rank)
                                             : std::string("too few layers for ") + std::to_string(per_rank) +
                                                   " stages per rank") +
                     (given("--virtual") ? std::string(" or a smaller --virtual") : std::string(" (or a schedule with "
                                                                                                "one stage per rank)")));
  }
  const std::vector<int> b = plan_balance(p, total_stages, balance, parse_balance_solver(balance_solver));
  StageCostOptions o;
  o.micro_batch = microbatch_size > 0 ? microbatch_size : p.micro_batch_size;
  std::tie(o.bandwidth_bytes_per_ms, o.latency_ms) = transfer_options(p);
  return stage_costs(p, b, o);  // with the profile's per-action overhead, if it has one
}

CostModel ScheduleFlags::costs(const Schedule& s) const {
  if (skip_bandwidth < 0 || !(skip_bandwidth < 1e300))
    throw UsageError("--skip-bandwidth " + std::to_string(skip_bandwidth) + " must be finite and >= 0 (0: unlimited)");
  CostModel c = base_costs(s);
  c.bandwidth = skip_bandwidth;
  return c;
}

CostModel ScheduleFlags::base_costs(const Schedule& s) const {
  if (!profile.empty()) {
    CostModel c = profile_costs(s.stages, s.ranks);
    if (s.replicated()) {  // a replicated stage's step carries the all-reduce of its replicas' gradients
      const Profile p = load_profile_flags();
      std::vector<int> counts;
      for (int st = 0; st < s.stages; ++st) counts.push_back(s.replicas_of(st));
      const auto [bandwidth, latency] = transfer_options(p);
      add_stage_step(c, replica_allreduce_ms(p, plan_balance(p, s.stages, balance, parse_balance_solver(balance_solver)),
                                             counts, bandwidth, latency));
    }
    return c;
  }
  const std::vector<StageCost> given = parse_stage_costs(cost);
  if (comm < 0) throw UsageError("--comm " + std::to_string(comm) + " must be >= 0");
  return costs_from_triples(s, given, comm, "--cost");
}

namespace {
int g_argc = 0;
char** g_argv = nullptr;
}  // namespace

void set_command_line(int argc, char** argv) {
  g_argc = argc;
  g_argv = argv;
}
int cli_argc() { return g_argc; }
char** cli_argv() { return g_argv; }

std::vector<std::string> subcommand_names(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) out.push_back(sub->get_name());
  return out;
}

std::vector<std::string> long_flag_names(const CLI::App& sub) {
  std::vector<std::string> out{"--help"};  // --config where the command has it, as its own option
  for (const CLI::Option* o : sub.get_options())
    for (const std::string& n : o->get_lnames()) out.push_back("--" + n);
  return out;
}

std::vector<std::string> expand_config(const std::vector<std::string>& args, const CLI::App* app) {
  // launch's own flags come before the command it starts, and a --config after it is the command's.
  if (args.size() > 1 && args[1] == "launch") return args;
  std::string file;
  std::size_t at = 0;
  for (std::size_t i = 2; i < args.size(); ++i) {
    if (args[i] == "--") break;  // what follows belongs to another program
    std::string named;
    if (args[i] == "--config" && i + 1 < args.size()) named = args[i + 1];
    else if (args[i].rfind("--config=", 0) == 0) named = args[i].substr(9);
    else continue;
    // A second file replaced the first without a word ({"steps": 1} in it dropped: 600 steps trained).
    if (at != 0)
      throw UsageError("--config is given twice (" + excerpt(file) + " and " + excerpt(named) +
                       "): give one file, with every flag in it (flags on the command line override it)");
    file = named;
    at = i;
  }
  if (at == 0) return args;
  std::vector<std::string> flags;
  const CLI::App* sub = nullptr;
  if (app)
    for (const CLI::App* s : app->get_subcommands([](const CLI::App*) { return true; }))
      if (s->get_name() == args[1]) sub = s;
  // Only commands with a --config option take a file (train): others read it, checked its keys, and then
  // failed with CLI11's "The following arguments were not expected: FILE --config"; info's --config is
  // a switch of its own.
  if (sub) {
    const CLI::Option* own = sub->get_option_no_throw("--config");
    if (!own) {
      std::vector<std::string> with;
      for (const CLI::App* s : app->get_subcommands([](const CLI::App*) { return true; })) {
        const CLI::Option* o = s->get_option_no_throw("--config");
        if (o && o->get_items_expected_max() > 0) with.push_back("pipetrain " + s->get_name());
      }
      std::string names;
      for (const std::string& w : with) names += (names.empty() ? "" : ", ") + w;
      throw UsageError("--config FILE is not a flag of pipetrain " + args[1] + (names.empty() ? "" : " (" + names +
                       " takes one)") + ": give its flags on the command line");
    }
    if (own->get_items_expected_max() == 0) return args;  // a switch (info --config), not a file
  }
  for (const ConfigFlag& c : parse_config_text(read_file_capped(file, "config file", kMaxConfigFileBytes), file)) {
    if (sub) {  // each key must be a flag of the command, with as many values as it takes
      const CLI::Option* o = sub->get_option_no_throw(c.flag);
      if (!o || o->get_lnames().empty()) {
        std::vector<std::string> keys;
        for (const std::string& f : long_flag_names(*sub))
          if (f != "--help" && f != "--config") keys.push_back(f.substr(2));
        throw UsageError("--config " + file + ": key '" + excerpt(c.key) + "' is not a flag of pipetrain " + args[1] +
                         did_you_mean(c.key, keys) + "; run 'pipetrain " + args[1] + " --help' for its flags");
      }
      const bool flag_only = o->get_items_expected_max() == 0;  // add_flag: expected(0)
      // false dropped the key: {"steps": false} trained the default steps, {"lr": false} the default rate.
      if (c.off && !flag_only)
        throw UsageError("--config " + file + ": key '" + excerpt(c.key) + "' is false, but --" + excerpt(c.key) +
                         " takes a value (false is only for on/off flags): give its value, or drop the key");
      if (flag_only && !c.values.empty())
        throw UsageError("--config " + file + ": key '" + excerpt(c.key) + "' is an on/off flag, but its value is '" +
                         excerpt(c.values.front()) + "': give true or false");
      if (!flag_only && c.values.empty())
        throw UsageError("--config " + file + ": key '" + excerpt(c.key) + "' needs a value (true is only for on/off flags)");
      if (o->get_items_expected_max() == 1 && c.values.size() > 1)
        throw UsageError("--config " + file + ": key '" + excerpt(c.key) + "' takes one value, but its value is an array of " +
                         std::to_string(c.values.size()) + ": give a single value");
    }
    if (c.off) continue;  // an on/off flag left off (with a command, refused above for a value flag)
    flags.push_back(c.flag);
    flags.insert(flags.end(), c.values.begin(), c.values.end());
  }
  std::vector<std::string> out(args.begin(), args.begin() + 2);
  out.insert(out.end(), flags.begin(), flags.end());
  out.insert(out.end(), args.begin() + 2, args.end());
  return out;
}

void refuse_non_finite(CLI::App& cmd) {
  for (CLI::Option* o : cmd.get_options()) {
    if (o->get_type_name().rfind("FLOAT", 0) != 0) continue;
    o->check(CLI::Validator(
        [](std::string& value) -> std::string {
          const char* begin = value.c_str();
          char* end = nullptr;
          const double d = std::strtod(begin, &end);
          if (end == begin || *end != '\0' || std::isfinite(d)) return "";  // a number, or CLI11's to refuse
          return excerpt(value) + " is not a finite number (nan, inf or past 1.8e308): give a finite value";
        },
        "", "finite"));
  }
}

void check_values(CLI::App& cmd) {
  // Every name of the command's options, as a value would spell it.
  auto names = std::make_shared<std::vector<std::string>>();
  for (const CLI::Option* o : cmd.get_options()) {
    for (const std::string& l : o->get_lnames()) names->push_back("--" + l);
    for (const std::string& n : o->get_snames()) names->push_back("-" + n);
  }
  for (CLI::Option* o : cmd.get_options()) {
    if (o->get_items_expected_max() == 0 || o->get_lnames().empty()) continue;  // on/off flags, positionals
    const std::string type = o->get_type_name();
    const bool is_unsigned = type.rfind("UINT", 0) == 0;
    const bool integer = type.rfind("INT", 0) == 0 || is_unsigned;
    const bool number = integer || type.rfind("FLOAT", 0) == 0;
    const std::string name = o->get_name();
    o->transform(CLI::Validator(  // a transform: it may trim the value it checks
        [names, integer, is_unsigned, number, name](std::string& value) -> std::string {
          // A value flag followed by another flag took it as its value: `--svg --json` wrote a file named
          // "--json", `--save --memory` a checkpoint folder "--memory".
          const std::string word = value.substr(0, value.find('='));
          if (std::find(names->begin(), names->end(), word) != names->end())
            return name + " took " + excerpt(value) + " as its value, but that is a flag of this command: give " +
                   name + " its value first";
          if (!number) return "";
          // CLI11 reads an empty string as 0: `--clip "$UNSET"` turned clipping off.
          if (value.find_first_not_of(" \t") == std::string::npos)
            return name + " was given an empty value (an unset shell variable?): give a number, or drop " + name;
          // Blanks around a number (`-m "$(wc -l < f)"` on BSD, "2, 1" in a list) are not part of it.
          value.erase(0, value.find_first_not_of(" \t"));
          value.erase(value.find_last_not_of(" \t") + 1);
          if (!integer) return "";
          // CLI11 reads integers with strtoll's base 0: `-p 010` ran 8 stages, `-m 0x10` 16 micro-batches.
          std::size_t digits = value[0] == '-' || value[0] == '+' ? 1 : 0;
          // An unsigned flag wraps a negative value (`plan --seed -1` was seed 2^64 - 1).
          if (is_unsigned && value[0] == '-')
            return name + " takes a whole number >= 0, got " + excerpt(value);
          const std::string body = value.substr(digits);
          if (!body.empty() && body.find_first_not_of("0123456789") == std::string::npos) {
            if (body.size() > 1 && body[0] == '0') {
              const std::size_t nz = body.find_first_not_of('0');
              const std::string plain = value.substr(0, digits) + (nz == std::string::npos ? "0" : body.substr(nz));
              return name + " " + excerpt(value) + " has a leading zero (it would be read as octal): write " + plain;
            }
            return "";
          }
          if (body.size() > 2 && body[0] == '0' && (body[1] == 'x' || body[1] == 'X'))
            return name + " " + excerpt(value) + " is hexadecimal: write the number in decimal";
          // 8.0, 1e1, a --config file's 2.0: a whole number written as a decimal one.
          char* end = nullptr;
          const double d = std::strtod(value.c_str(), &end);
          if (end != value.c_str() && *end == '\0' && std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 1e15)
            return name + " takes a whole number, got " + excerpt(value) + ": write " +
                   std::to_string(static_cast<long long>(d));
          if (end != value.c_str() && *end == '\0')
            return name + " takes a whole number, got " + excerpt(value);
          return "";  // not a number at all: CLI11 refuses it
        },
        "", "value"));
  }
}

std::string integer_range_hint(CLI::App& sub, const std::string& message) {
  const std::string prefix = "Could not convert: ";
  if (message.rfind(prefix, 0) != 0) return "";
  for (CLI::Option* o : sub.get_options()) {
    if (message.rfind(prefix + o->get_name() + " = ", 0) != 0) continue;
    const std::string type = o->get_type_name();
    const bool is_unsigned = type.rfind("UINT", 0) == 0;
    if (!is_unsigned && type.rfind("INT", 0) != 0) return "";
    auto converts = [&](const std::string& value) {
      o->clear();
      o->add_result(value);
      try {
        o->run_callback();
        return true;
      } catch (const CLI::ParseError&) {
        return false;
      }
    };
    std::string lo = "0", hi;
    if (is_unsigned) {
      hi = converts("4294967296") ? "18446744073709551615" : "4294967295";
    } else {
      const bool wide = converts("2147483648");
      lo = wide ? "-9223372036854775808" : "-2147483648";
      hi = wide ? "9223372036854775807" : "2147483647";
    }
    return o->get_name() + " takes a whole number from " + lo + " to " + hi +
           ": give one in that range (its own limits, if any, are checked next)";
  }
  return "";
}

int guarded(const std::string& command, const std::function<int()>& body) {
  // Messages quote input files and flags: escape_controls keeps a file's escape sequences from reaching
  // the terminal (\x1b[2J cleared the screen).
  try {
    return body();
  } catch (const UsageError& e) {
    std::cerr << "pipetrain " << command << ": error: " << escape_controls(e.what()) << "\n";
    return kExitUsage;
  } catch (const std::exception& e) {
    std::cerr << "pipetrain " << command << ": error: " << escape_controls(e.what()) << "\n";
    return kExitFailure;
  }
}

}  // namespace pipetrain::cli

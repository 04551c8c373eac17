// PyTorch's schedule CSV (core/torch_csv.h): round trips both ways with both letter sets for every
// built-in schedule that has a PyTorch form, PyTorch-written files from its test artifacts
// (data/pytorch/, see its README), a hand-derived lock-step layout, and malformed input.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/torch_csv.h"
#include "pipetrain/core/validate.h"

using namespace pipetrain;

namespace {

std::string pytorch_data(const std::string& file) { return std::string(PIPETRAIN_SOURCE_DIR) + "/data/pytorch/" + file; }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path << " is missing; it is part of the repository (data/pytorch/)";
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string error_of(const std::string& text, const TorchCsvReadOptions& o = {}) {
  try {
    from_torch_csv(text, o);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "accepted";
}

// The schedules of every generator over a few sizes (interleaved needs m % p == 0).
std::vector<Schedule> built_in_schedules() {
  std::vector<Schedule> out;
  for (const std::string& name : schedule_names())
    for (int p : {1, 2, 3, 4})
      for (int m : {p, 2 * p, 2 * p + 1})
        for (int v : {1, 2}) {
          if (v > 1 && !schedule_traits(name).virtual_stages) continue;
          GeneratorOptions o;
          o.ranks = p;
          o.microbatches = m;
          o.virtual_stages = v;
          try {
            out.push_back(generate(name, o));
          } catch (const UsageError&) {  // a size this generator does not take (e.g. interleaved, m % p != 0)
          }
        }
  return out;
}

bool has_torch_form(const Schedule& s) {
  return !s.replicated() && s.synchronous && s.steps() == 1;
}

}  // namespace

TEST(TorchCsv, EveryBuiltInScheduleRoundTripsInBothLetterSetsAndForms) {
  int mapped = 0;
  std::map<std::string, int> refused;
  for (const Schedule& base : built_in_schedules()) {
    if (!has_torch_form(base)) {
      ++refused[base.name];
      try {
        to_torch_csv(base);
        ADD_FAILURE() << base.name << " has no PyTorch form but was written";
      } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("one synchronous step"), std::string::npos) << e.what();
      }
      continue;
    }
    for (bool lowered : {false, true}) {
      const Schedule s = lowered ? insert_communication(base) : base;
      for (TorchLetters letters : {TorchLetters::current, TorchLetters::legacy}) {
        SCOPED_TRACE(s.name + " p=" + std::to_string(s.ranks) + " m=" + std::to_string(s.microbatches) +
                     " stages=" + std::to_string(s.stages) + (lowered ? " lowered " : " ") + to_string(letters));
        TorchCsvWriteOptions w;
        w.letters = letters;
        const std::string text = to_torch_csv(s, w);
        // ours -> PyTorch -> ours: the same schedule (the generators put the optimizer steps last, where
        // the reader puts them back), with the letters and the form detected.
        TorchCsvReadOptions r;
        r.name = s.name;
        const TorchCsvRead back = from_torch_csv(text, r);
        EXPECT_EQ(back.schedule, s);
        EXPECT_EQ(back.letters, letters);
        bool transfers = false;  // a one-rank schedule has none even lowered
        for (const auto& row : s.actions)
          for (const Action& a : row) transfers |= is_comm(a.kind);
        EXPECT_EQ(back.with_communication, transfers);
        EXPECT_NO_THROW(validate(back.schedule));
        // PyTorch -> ours -> PyTorch: the same text.
        EXPECT_EQ(to_torch_csv(back.schedule, w), text);
        // Read with the letters named rather than detected: the same.
        r.letters = letters;
        EXPECT_EQ(from_torch_csv(text, r).schedule, s);
        ++mapped;
      }
    }
  }
  // Every synchronous generator maps; the asynchronous ones (one step per micro-batch, or no flush) do not.
  EXPECT_GT(mapped, 100);
  EXPECT_GT(refused.count("pipedream"), 0u);
  EXPECT_GT(refused.count("2bw"), 0u);
  for (const auto& [name, n] : refused) EXPECT_FALSE(schedule_traits(name).synchronous) << name << " was refused";
}

TEST(TorchCsv, ComputeOnlyFormIsInLockStep) {
  // GPipe, p = 2, m = 2 by hand: rank 1's first forward waits one column for rank 0's; rank 0's first
  // backward (of micro-batch 1) waits for rank 1's, made in column 3.
  EXPECT_EQ(to_torch_csv(gpipe(2, 2)), "0F0,0F1,,,0B1,0B0\n,1F0,1F1,1B1,1B0\n");
  TorchCsvWriteOptions legacy;
  legacy.letters = TorchLetters::legacy;
  EXPECT_EQ(to_torch_csv(gpipe(2, 2), legacy), "0F0,0F1,,,0BW1,0BW0\n,1F0,1F1,1BW1,1BW0\n");
  TorchCsvWriteOptions packed;
  packed.idle_cells = false;
  EXPECT_EQ(to_torch_csv(gpipe(2, 2), packed), "0F0,0F1,0B1,0B0\n1F0,1F1,1B1,1B0\n");
  // In general: every action sits in a later column than what it needs from another rank.
  for (const Schedule& s : {one_f_one_b(4, 8), interleaved(2, 4, 2), zb_h1(3, 6)}) {
    const std::string text = to_torch_csv(s);
    std::map<std::string, std::pair<int, int>> at;  // cell -> (rank, column)
    std::istringstream lines(text);
    std::string line;
    for (int r = 0; std::getline(lines, line); ++r) {
      std::stringstream cells(line);
      std::string cell;
      for (int c = 0; std::getline(cells, cell, ','); ++c)
        if (!cell.empty()) at[cell] = {r, c};
    }
    for (const auto& [cell, rc] : at) {
      const std::size_t k = cell.find_first_not_of("0123456789");
      const int stage = std::stoi(cell.substr(0, k));
      const std::string kind = cell.substr(k, cell.find_first_of("0123456789", k) - k);
      const std::string micro = cell.substr(cell.find_first_of("0123456789", k));
      std::vector<std::string> needs;
      if (kind == "F" && stage > 0) needs.push_back(std::to_string(stage - 1) + "F" + micro);
      if ((kind == "B" || kind == "I") && stage + 1 < s.stages) {
        const std::string next = std::to_string(stage + 1);
        needs.push_back(at.count(next + "B" + micro) ? next + "B" + micro : next + "I" + micro);
      }
      for (const std::string& n : needs) {
        ASSERT_TRUE(at.count(n)) << n;
        if (at[n].first != rc.first) {
          EXPECT_GT(rc.second, at[n].second) << cell << " needs " << n << "\n" << text;
        }
      }
    }
  }
}

TEST(TorchCsv, PyTorchWrittenFilesLoadAndValidate) {
  struct File {
    std::string name;
    TorchLetters letters;
    bool comms;
  };
  const std::vector<File> files = {{"zb1p_2rank_2stagep_compute.csv", TorchLetters::current, false},
                                   {"zb1p_2rank_2stagep_compute_legacy.csv", TorchLetters::legacy, false},
                                   {"zb1p_2rank_2stagep_comms.csv", TorchLetters::current, true},
                                   {"zb1p_2rank_2stagep_comms_legacy.csv", TorchLetters::legacy, true}};
  std::vector<Schedule> read;
  for (const File& f : files) {
    SCOPED_TRACE(f.name);
    const TorchCsvRead r = load_torch_csv_file(pytorch_data(f.name));
    EXPECT_EQ(r.letters, f.letters);
    EXPECT_EQ(r.with_communication, f.comms);
    const Schedule& s = r.schedule;
    EXPECT_EQ(s.ranks, 2);
    EXPECT_EQ(s.stages, 4);
    EXPECT_EQ(s.microbatches, 8);
    EXPECT_EQ(s.stage_rank, (std::vector<int>{0, 1, 0, 1}));  // looped: stage s on rank s mod 2
    EXPECT_NO_THROW(validate(s));
    read.push_back(s);
    TorchCsvWriteOptions w;
    w.letters = f.letters;
    if (f.comms) {
      // A lowered schedule has no idle cells: written back, the file is the same byte for byte.
      EXPECT_EQ(to_torch_csv(s, w), slurp(pytorch_data(f.name)));
    } else {
      // Our lock-step layout places idle cells by its own rule; the actions, in order, are the same.
      EXPECT_EQ(from_torch_csv(to_torch_csv(s, w)).schedule, s);
    }
  }
  // The two letter sets spell the same schedules.
  EXPECT_EQ(read[0], read[1]);
  EXPECT_EQ(read[2], read[3]);
  // And the form with communication is the compute-only one lowered: the same compute actions in the same
  // order, except that PyTorch merged an I directly followed by its W into one full backward.
  const Schedule stripped = strip_communication(read[2]);
  for (int r = 0; r < 2; ++r) {
    std::vector<Action> merged;
    const auto& row = read[0].actions[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < row.size(); ++i) {
      if (row[i].kind == ActionKind::B && i + 1 < row.size() && row[i + 1] == Action{ActionKind::W, row[i].stage, row[i].index}) {
        merged.push_back({ActionKind::BW, row[i].stage, row[i].index});
        ++i;
      } else {
        merged.push_back(row[i]);
      }
    }
    EXPECT_EQ(stripped.actions[static_cast<std::size_t>(r)], merged) << "rank " << r;
  }
}

TEST(TorchCsv, PairedCellsReadAsPairsAndWriteBack) {
  // PyTorch's DualPipeV dump: 4 ranks, a V placement (rank r holds stages r and 7 - r), paired slots.
  const std::string text = slurp(pytorch_data("dualpipev_4rank_10mb.csv"));
  const TorchCsvRead r = from_torch_csv(text);
  const Schedule& s = r.schedule;
  EXPECT_EQ(s.stage_rank, (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0}));
  const auto& row0 = s.actions[0];
  // Cell 18 of line 1, (0F7;7B3)OVERLAP_F_B: the forward opens the pair, the full backward follows.
  ASSERT_GT(row0.size(), 18u);
  EXPECT_EQ(row0[17], (Action{ActionKind::F, 0, 7}));
  EXPECT_TRUE(row0[17].paired);
  EXPECT_EQ(row0[18], (Action{ActionKind::BW, 7, 3}));
  EXPECT_FALSE(row0[18].paired);
  int pairs = 0;
  for (const auto& row : s.actions)
    for (const Action& a : row) pairs += a.paired;
  EXPECT_GT(pairs, 8);
  validate(s);  // pairs are a forward and a backward of another stage, in data order
  // Written back compactly (without idle cells), the first row is PyTorch's own, pairs included.
  TorchCsvWriteOptions w;
  w.idle_cells = false;
  const std::string back = to_torch_csv(s, w);
  EXPECT_EQ(back.substr(0, back.find('\n')), text.substr(0, text.find('\n')));
  // Malformed pairs are refused naming the cell.
  for (const char* bad : {"(0F0;0B0", "(0F0)OVERLAP_F_B", "(0F0;1B0)OVERLAP", "(0B0;1F0)OVERLAP_F_B"}) {
    const std::string e = error_of(bad);
    EXPECT_NE(e.find(std::string("'") + bad + "'"), std::string::npos) << e;
  }
}

TEST(TorchCsv, SkipsShardingCellsAndReadsCsvQuoting) {
  const TorchCsvRead r = from_torch_csv("0UNSHARD, 0F0 ,\"0B0\",0RESHARD,0REDUCE_GRAD\r\n");
  EXPECT_EQ(r.schedule.actions, (std::vector<std::vector<Action>>{
                                    {{ActionKind::F, 0, 0}, {ActionKind::BW, 0, 0}, {ActionKind::Step, 0, 0}}}));
  ASSERT_EQ(r.notes.size(), 2u);
  EXPECT_NE(r.notes[0].find("skipped 3"), std::string::npos);
  // An empty line is a rank with nothing to do, as in Python's csv reader; the final line break is not.
  const TorchCsvRead idle = from_torch_csv("0F0,0B0\n\n");
  EXPECT_EQ(idle.schedule.ranks, 2);
  EXPECT_TRUE(idle.schedule.actions[1].empty());
  // Without steps, and with the placement given.
  TorchCsvReadOptions o;
  o.add_steps = false;
  o.stages = 2;
  o.stage_rank = {0, 0};
  const TorchCsvRead v = from_torch_csv("0F0,1F0,1B0,0B0\n", o);
  EXPECT_EQ(v.schedule.stage_rank, (std::vector<int>{0, 0}));
  EXPECT_EQ(v.schedule.actions[0].size(), 4u);
  EXPECT_NO_THROW(validate(v.schedule));
}

TEST(TorchCsv, MalformedInputNamesLineAndCell) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"0F0,0X1\n", "line 1, cell 2: '0X1' has no known action kind"},
      {"0F0\n1F0,1F\n", "line 2, cell 2: '1F' has no micro-batch number"},
      {"F0\n", "'F0' does not start with a stage number"},
      {"0F0x\n", "'0F0x' has 'x' after its action"},
      {"0F0,0SEND_F0_1RECV_B0\n", "batched send and receive"},
      {"0F0,0I0,0W0\n1F0,1BW0\n", "mixes its two letter sets: line 1, cell 2 uses I"},
      {"0F99999999999\n", "too large"},
      {"0F16777216\n", "the limits are"},
      {"", "no rows"},
      {"0UNSHARD\n", "no actions with a micro-batch"},
      {"\"0F0,0B0\n", "line 1: a quoted cell is not closed"},
  };
  for (const auto& [text, want] : cases) EXPECT_NE(error_of(text).find(want), std::string::npos) << text << " -> " << error_of(text);
  TorchCsvReadOptions current;
  current.letters = TorchLetters::current;
  EXPECT_NE(error_of("0F0,0BW0\n", current).find("line 1, cell 2 uses BW"), std::string::npos);
  TorchCsvReadOptions legacy;
  legacy.letters = TorchLetters::legacy;
  EXPECT_NE(error_of("0F0,0I0,0W0\n", legacy).find("uses I"), std::string::npos);
  TorchCsvReadOptions placed;
  placed.stage_rank = {0};
  EXPECT_NE(error_of("0F0\n1F0\n", placed).find("lists 1 ranks but the schedule has 2 stages"), std::string::npos);
  placed.stage_rank = {0, 2};
  EXPECT_NE(error_of("0F0\n1F0\n", placed).find("names rank 2"), std::string::npos);
  TorchCsvReadOptions few;
  few.stages = 1;
  EXPECT_NE(error_of("0F0\n1F0\n", few).find("names stage 1"), std::string::npos);
  EXPECT_THROW(parse_torch_letters("old"), UsageError);
  EXPECT_EQ(parse_torch_letters("legacy"), TorchLetters::legacy);
  // The writer refuses what PyTorch's format cannot hold.
  TorchCsvWriteOptions detect;
  detect.letters = TorchLetters::detect;
  EXPECT_THROW(to_torch_csv(gpipe(2, 2), detect), UsageError);
  try {
    to_torch_csv(round_robin("1f1b", {2, 1}, 4));
    ADD_FAILURE() << "a replicated schedule was written";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("gives every stage one rank"), std::string::npos);
  }
  // A stage named on two rows reads, and the validator names the misplaced cell.
  const Schedule twice = from_torch_csv("0F0,0B0\n0F1,0B1\n").schedule;
  EXPECT_THROW(validate(twice), ScheduleError);
}

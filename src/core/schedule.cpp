#include "pipetrain/core/schedule.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/core/read_file.h"
#include "pipetrain/core/skip.h"
#include "pipetrain/core/validate.h"

namespace pipetrain {

bool operator==(const Schedule& a, const Schedule& b) {
  return a.name == b.name && a.ranks == b.ranks && a.stages == b.stages && a.microbatches == b.microbatches &&
         a.microbatches_per_step == b.microbatches_per_step && a.synchronous == b.synchronous &&
         a.stage_rank == b.stage_rank && a.stage_replicas == b.stage_replicas && a.actions == b.actions && a.skips == b.skips;
}

bool Schedule::holds(int rank, int stage) const {
  if (stage_replicas.empty()) return rank_of(stage) == rank;
  const auto& r = stage_replicas.at(static_cast<std::size_t>(stage));
  return std::find(r.begin(), r.end(), rank) != r.end();
}

int Schedule::first_stage_of(int rank) const {
  for (int s = 0; s < stages; ++s)
    if (holds(rank, s)) return s;
  return -1;
}

std::string rank_line(const Schedule& s, int rank) {
  std::string out;
  for (const std::string& cell : cell_texts(s.actions.at(static_cast<std::size_t>(rank)))) {
    if (!out.empty()) out += ' ';
    out += cell;
  }
  return out;
}

std::string to_csv(const Schedule& s) {
  check_ranges(s);
  std::ostringstream out;
  out << "# pipetrain schedule name=" << s.name << " ranks=" << s.ranks << " stages=" << s.stages
      << " microbatches=" << s.microbatches << " microbatches_per_step=" << s.microbatches_per_step
      << " synchronous=" << (s.synchronous ? 1 : 0) << " stage_rank=";
  for (std::size_t i = 0; i < s.stage_rank.size(); ++i) out << (i ? ":" : "") << s.stage_rank[i];
  if (s.replicated()) {
    out << " stage_replicas=";
    for (std::size_t i = 0; i < s.stage_replicas.size(); ++i) {
      out << (i ? ":" : "");
      for (std::size_t k = 0; k < s.stage_replicas[i].size(); ++k) out << (k ? "/" : "") << s.stage_replicas[i][k];
    }
  }
  if (!s.skips.empty()) {
    out << " skips=";
    for (std::size_t i = 0; i < s.skips.size(); ++i)
      out << (i ? "," : "") << s.skips[i].from_stage << ':' << s.skips[i].to_stage << ':' << s.skips[i].size;
  }
  out << '\n';
  for (int r = 0; r < s.ranks; ++r) {
    const auto& row = s.actions[static_cast<std::size_t>(r)];
    // A paired slot (action.h) is one cell (0F7;7BW3); transfers a lowered schedule runs between its two
    // halves keep their place: (0F7; then the transfers then 7BW3), one cell each.
    std::size_t close = row.size();  // the closing half of the open pair
    bool first = true;
    for (std::size_t i = 0; i < row.size(); ++i) {
      std::string cell = to_string(row[i]);
      if (i == close) {
        cell += ')';
        close = row.size();
      } else if (row[i].paired) {
        std::size_t j = i + 1;
        while (j < row.size() && !is_compute(row[j].kind)) ++j;
        if (j == row.size()) {
          // a dangling pair (the validator names it) is written as its action
        } else if (j == i + 1) {
          cell = "(" + cell + ";" + to_string(row[j]) + ")";
          ++i;
        } else {
          cell = "(" + cell + ";";
          close = j;
        }
      }
      out << (first ? "" : ",") << cell;
      first = false;
    }
    out << '\n';
  }
  return out.str();
}

namespace {

int header_int(const std::map<std::string, std::string>& kv, const std::string& key, int fallback,
               int line_no) {
  auto it = kv.find(key);
  if (it == kv.end()) return fallback;
  try {
    std::size_t used = 0;
    const int v = std::stoi(it->second, &used);
    if (used != it->second.size()) throw std::invalid_argument(it->second);
    return v;
  } catch (const std::exception&) {
    throw UsageError("CSV line " + std::to_string(line_no) + ": header value " + key + "=" + it->second +
                     " is not an integer");
  }
}

std::vector<int> parse_stage_rank(const std::string& text, int line_no) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ':')) {
    try {
      out.push_back(std::stoi(item));
    } catch (const std::exception&) {
      throw UsageError("CSV line " + std::to_string(line_no) + ": stage_rank=" + text +
                       " must be rank numbers separated by ':' (e.g. stage_rank=0:1:0:1)");
    }
  }
  return out;
}

}  // namespace

Schedule from_csv(const std::string& text) {
  Schedule s;
  std::map<std::string, std::string> header;
  int header_line = 0;
  std::vector<std::vector<Action>> rows;
  std::istringstream in{std::string(skip_utf8_bom(text))};  // a leading byte order mark is no cell
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const auto first = line.find_first_not_of(" \t");
    if (first == std::string::npos) continue;
    if (line[first] == '#') {
      std::istringstream words(line.substr(first + 1));
      std::string word;
      words >> word;
      if (word != "pipetrain") continue;
      header_line = line_no;
      while (words >> word) {
        const auto eq = word.find('=');
        if (eq != std::string::npos) header[word.substr(0, eq)] = word.substr(eq + 1);
      }
      continue;
    }
    std::vector<Action> row;
    std::stringstream cells(line);
    std::string cell;
    int col = 0, empty_col = 0;
    bool open_pair = false;  // a cell "(0F7;" opened a pair that a later cell "7BW3)" closes
    while (std::getline(cells, cell, ',')) {
      ++col;
      if (cell.find_first_not_of(" \t") == std::string::npos) {  // trailing empty cells (padding) are fine
        if (empty_col == 0) empty_col = col;
        continue;
      }
      if (empty_col > 0)
        throw UsageError("CSV line " + std::to_string(line_no) + " (rank " + std::to_string(rows.size()) + "), column " +
                         std::to_string(empty_col) +
                         ": empty cell between actions; a row lists its rank's actions in order, so remove the empty "
                         "cell; a schedule PyTorch dumped, whose empty cells are idle slots, is read by the PyTorch CSV "
                         "reader (core/torch_csv.h; pipetrain simulate --format torch, pipetrain schedule "
                         "--load-format torch)");
      try {
        std::string_view t = cell;
        while (!t.empty() && (t.front() == ' ' || t.front() == '\t')) t.remove_prefix(1);
        while (!t.empty() && (t.back() == ' ' || t.back() == '\t' || t.back() == '\r')) t.remove_suffix(1);
        if (!t.empty() && t.front() == '(' && t.back() == ';') {  // a pair with transfers between its halves
          if (open_pair)
            throw UsageError("'" + std::string(t) + "' opens a paired slot inside another: close the first with ')'");
          row.push_back(parse_action(t.substr(1, t.size() - 2)));
          row.back().paired = true;
          open_pair = true;
        } else if (open_pair && !t.empty() && t.back() == ')') {
          row.push_back(parse_action(t.substr(0, t.size() - 1)));
          open_pair = false;
        } else {
          for (Action& a : parse_cell(t)) row.push_back(a);
          if (open_pair && is_compute(row.back().kind))
            throw UsageError("'" + std::string(t) + "' is the compute action that closes the paired slot opened "
                             "before it: write it as " + std::string(t) + ")");
        }
      } catch (const UsageError& e) {
        // PyTorch's actions (0SEND_F0, 7I0, 2UNSHARD, (0F7;7B3)OVERLAP_F_B): say which reader takes them.
        const bool torch_like = cell.find('_') != std::string::npos || cell.find("OVERLAP") != std::string::npos ||
                                (cell.find('I') != std::string::npos && cell.find('(') == std::string::npos) ||
                                cell.find("SHARD") != std::string::npos;
        throw UsageError("CSV line " + std::to_string(line_no) + ", cell " + std::to_string(col) + ": " +
                         e.what() +
                         (torch_like ? std::string("; this looks like PyTorch's schedule CSV, which the PyTorch "
                                                   "CSV reader takes (core/torch_csv.h; pipetrain simulate --format "
                                                   "torch, pipetrain schedule --load-format torch)")
                                     : std::string()));
      }
    }
    if (open_pair)
      throw UsageError("CSV line " + std::to_string(line_no) + ": a paired slot opened with '(' is not closed: end "
                       "it with the backward that completes it, e.g. 7BW3)");
    rows.push_back(std::move(row));
  }
  if (rows.empty())
    throw UsageError("CSV schedule has no rows: write one line per rank, e.g. '0F0,0BW0' for one rank");

  int max_stage = -1, max_micro = -1;
  for (const auto& row : rows)
    for (const Action& a : row) {
      max_stage = std::max(max_stage, a.stage);
      if (a.kind != ActionKind::Step) max_micro = std::max(max_micro, a.index);
    }
  s.actions = std::move(rows);
  s.ranks = header_int(header, "ranks", static_cast<int>(s.actions.size()), header_line);
  if (s.ranks != static_cast<int>(s.actions.size()))
    throw UsageError("CSV header says ranks=" + std::to_string(s.ranks) + " but the file has " +
                     std::to_string(s.actions.size()) + " rows: write one row per rank");
  s.name = header.count("name") ? header["name"] : "custom";
  s.stages = header_int(header, "stages", max_stage + 1, header_line);
  s.microbatches = header_int(header, "microbatches", max_micro + 1, header_line);
  s.microbatches_per_step = header_int(header, "microbatches_per_step", s.microbatches, header_line);
  s.synchronous = header_int(header, "synchronous", 1, header_line) != 0;
  // Stage and micro-batch numbers size per-stage and per-(stage, micro-batch) tables downstream: a stray
  // 0F888888888 asked for 889 million stages (found by fuzz_schedule_csv).
  constexpr long kMaxStages = 1 << 16, kMaxMicrobatches = 1 << 24, kMaxCells = 1L << 26;
  if (s.stages > kMaxStages || s.microbatches > kMaxMicrobatches ||
      static_cast<long>(s.stages) * s.microbatches > kMaxCells)
    throw UsageError("CSV schedule has " + std::to_string(s.stages) + " stages and " + std::to_string(s.microbatches) +
                     " micro-batches (from the header or the largest numbers in its actions): the limits are " +
                     std::to_string(kMaxStages) + " stages, " + std::to_string(kMaxMicrobatches) +
                     " micro-batches and " + std::to_string(kMaxCells) +
                     " (stage, micro-batch) pairs; check the action numbers");
  if (s.stages < 1 || s.microbatches < 1 || s.microbatches_per_step < 1)
    throw UsageError("CSV schedule needs at least one stage and one micro-batch (got stages=" +
                     std::to_string(s.stages) + ", microbatches=" + std::to_string(s.microbatches) +
                     ", microbatches_per_step=" + std::to_string(s.microbatches_per_step) + ")");
  if (header.count("stage_rank")) {
    s.stage_rank = parse_stage_rank(header["stage_rank"], header_line);
  } else {
    // Infer the owner of each stage from the first rank whose row mentions it; a stage that never
    // appears goes to rank stage % ranks (the validator then reports its missing actions).
    s.stage_rank.assign(static_cast<std::size_t>(s.stages), -1);
    for (int r = 0; r < s.ranks; ++r)
      for (const Action& a : s.actions[static_cast<std::size_t>(r)])
        if (a.stage < s.stages && s.stage_rank[static_cast<std::size_t>(a.stage)] < 0)
          s.stage_rank[static_cast<std::size_t>(a.stage)] = r;
    for (int st = 0; st < s.stages; ++st)
      if (s.stage_rank[static_cast<std::size_t>(st)] < 0) s.stage_rank[static_cast<std::size_t>(st)] = st % s.ranks;
  }
  if (header.count("stage_replicas")) {
    // stage_replicas=0/1/2:3 -- per stage (':'-separated) its ranks in round-robin order ('/'-separated).
    std::stringstream stages(header["stage_replicas"]);
    std::string one;
    while (std::getline(stages, one, ':')) {
      if (one.empty())
        throw UsageError("CSV line " + std::to_string(header_line) + ": stage_replicas=" + header["stage_replicas"] +
                         " gives stage " + std::to_string(s.stage_replicas.size()) +
                         " no ranks: list each stage's ranks, stages separated by ':' and replicas by '/' (e.g. "
                         "stage_replicas=0/1:2)");
      std::replace(one.begin(), one.end(), '/', ':');
      std::vector<int> ranks;
      try {
        ranks = parse_stage_rank(one, header_line);
      } catch (const UsageError&) {
        throw UsageError("CSV line " + std::to_string(header_line) + ": stage_replicas=" + header["stage_replicas"] +
                         " must be rank numbers, stages separated by ':' and replicas by '/' (e.g. stage_replicas=0/1:2)");
      }
      if (ranks.empty())
        throw UsageError("CSV line " + std::to_string(header_line) + ": stage_replicas=" + header["stage_replicas"] +
                         " gives stage " + std::to_string(s.stage_replicas.size()) + " no ranks");
      s.stage_replicas.push_back(ranks);
    }
    if (static_cast<int>(s.stage_replicas.size()) != s.stages)
      throw UsageError("CSV header stage_replicas lists " + std::to_string(s.stage_replicas.size()) +
                       " stages but stages=" + std::to_string(s.stages) + ": give the ranks of every stage");
    std::vector<int> first;
    for (const auto& r : s.stage_replicas) first.push_back(r.front());
    if (header.count("stage_rank") && first != s.stage_rank)
      throw UsageError("CSV header stage_rank and stage_replicas disagree: each stage's owner must be its first "
                       "replica");
    s.stage_rank = first;
  }
  if (static_cast<int>(s.stage_rank.size()) != s.stages)
    throw UsageError("CSV header stage_rank lists " + std::to_string(s.stage_rank.size()) +
                     " owners but stages=" + std::to_string(s.stages) + ": give one rank per stage");
  for (int r : s.stage_rank)
    if (r < 0 || r >= s.ranks)
      throw UsageError("CSV header stage_rank names rank " + std::to_string(r) + " but there are " +
                       std::to_string(s.ranks) + " ranks (0.." + std::to_string(s.ranks - 1) + ")");
  if (header.count("skips")) {
    std::stringstream routes(header["skips"]);
    std::string one;
    while (std::getline(routes, one, ',')) {
      try {
        s.skips.push_back(parse_skip_route(one));
      } catch (const UsageError& e) {
        throw UsageError("CSV line " + std::to_string(header_line) + ": skips=" + header["skips"] + ": " + e.what());
      }
    }
  }
  check_ranges(s);  // a header's sizes that its cells exceed, replicas on missing ranks, skips to no stage
  return s;
}

Schedule load_csv_file(const std::string& path) {
  const std::string text = read_file_capped(path, "schedule file", kMaxScheduleFileBytes);
  try {
    return from_csv(text);
  } catch (const UsageError& e) {
    throw UsageError("schedule file '" + path + "': " + e.what());
  }
}

}  // namespace pipetrain

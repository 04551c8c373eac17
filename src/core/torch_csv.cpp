#include "pipetrain/core/torch_csv.h"

#include <algorithm>
#include <climits>
#include <optional>
#include <unordered_map>

#include "pipetrain/core/dependencies.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/core/read_file.h"

namespace pipetrain {

namespace {

// Sizes above these would make per-stage and per-(stage, micro-batch) tables downstream huge; a stray
// cell such as 0F888888888 must be an error, not an allocation (the same limits as from_csv).
constexpr long kMaxStages = 1 << 16, kMaxMicrobatches = 1 << 24, kMaxCells = 1L << 26;

// The kind words a cell may carry, longest first where one is a prefix of another.
enum class Word { F, I, W, B, BW, SendF, RecvF, SendB, RecvB, Unshard, Reshard, ReduceGrad };
struct WordName {
  const char* text;
  Word word;
};
constexpr WordName kWords[] = {{"REDUCE_GRAD", Word::ReduceGrad}, {"UNSHARD", Word::Unshard},
                               {"RESHARD", Word::Reshard},        {"SEND_F", Word::SendF},
                               {"RECV_F", Word::RecvF},           {"SEND_B", Word::SendB},
                               {"RECV_B", Word::RecvB},           {"BW", Word::BW},
                               {"F", Word::F},                    {"I", Word::I},
                               {"W", Word::W},                    {"B", Word::B}};

bool ignored(Word w) { return w == Word::Unshard || w == Word::Reshard || w == Word::ReduceGrad; }

struct Cell {
  int line = 0, col = 0;
  int stage = 0;
  Word word = Word::F;
  int micro = -1;  // -1: none written
  bool paired = false;  // the forward of an OVERLAP_F_B pair (the next cell in the row is its backward)
};

std::string where(int line, int col) { return "line " + std::to_string(line) + ", cell " + std::to_string(col); }

const char* kForm =
    "a cell is <stage><KIND><micro-batch>, e.g. 2F0 or 1SEND_F3, with KIND one of F, I, W, B (current letters), "
    "BW (older letters), SEND_F, RECV_F, SEND_B, RECV_B, or UNSHARD, RESHARD, REDUCE_GRAD without a micro-batch";

// Reads a run of digits at `pos` into `out`; false when there is none. Throws on overflow.
bool read_number(const std::string& s, std::size_t& pos, long& out, int line, int col, const std::string& cell) {
  const std::size_t start = pos;
  out = 0;
  while (pos < s.size() && s[pos] >= '0' && s[pos] <= '9') {
    out = out * 10 + (s[pos] - '0');
    if (out > INT_MAX)
      throw UsageError("PyTorch schedule CSV " + where(line, col) + ": '" + excerpt(cell) +
                       "' has a number too large for a stage or micro-batch");
    ++pos;
  }
  return pos > start;
}

Cell parse_one(const std::string& cell, int line, int col) {
  auto bad = [&](const std::string& why) {
    return UsageError("PyTorch schedule CSV " + where(line, col) + ": '" + excerpt(cell) + "' " + why);
  };
  Cell c;
  c.line = line;
  c.col = col;
  std::size_t pos = 0;
  long number = 0;
  if (!read_number(cell, pos, number, line, col, cell)) throw bad(std::string("does not start with a stage number: ") + kForm);
  c.stage = static_cast<int>(number);
  bool matched = false;
  for (const WordName& w : kWords) {
    const std::size_t n = std::char_traits<char>::length(w.text);
    if (cell.compare(pos, n, w.text) == 0) {
      c.word = w.word;
      pos += n;
      matched = true;
      break;
    }
  }
  if (!matched) throw bad(std::string("has no known action kind after its stage: ") + kForm);
  if (read_number(cell, pos, number, line, col, cell)) c.micro = static_cast<int>(number);
  if (pos < cell.size()) {
    if (cell[pos] == '_' && (c.word == Word::SendF || c.word == Word::SendB))
      throw bad("is a batched send and receive (older PyTorch's SEND_F_RECV_B / SEND_B_RECV_F): not supported; write "
                "the send and the receive as two cells");
    throw bad("has '" + excerpt(cell.substr(pos)) + "' after its action: " + kForm);
  }
  if (ignored(c.word)) return c;
  if (c.micro < 0) throw bad("has no micro-batch number: write it after the kind, e.g. " + cell + "0");
  return c;
}

// One cell: an action, or a pair "(<forward>;<backward>)OVERLAP_F_B" (DualPipeV's overlapped slot),
// returned as the forward marked `paired` followed by the backward.
std::vector<Cell> parse_cell(const std::string& cell, int line, int col) {
  if (cell.front() != '(') return {parse_one(cell, line, col)};
  const std::size_t semi = cell.find(';'), close = cell.find(')');
  const std::string tail = close == std::string::npos ? "" : cell.substr(close + 1);
  if (semi == std::string::npos || close == std::string::npos || semi > close || tail != "OVERLAP_F_B")
    throw UsageError("PyTorch schedule CSV " + where(line, col) + ": '" + excerpt(cell) +
                     "' is not a paired cell: write (<forward>;<backward>)OVERLAP_F_B, e.g. (0F7;7B3)OVERLAP_F_B");
  Cell f = parse_one(cell.substr(1, semi - 1), line, col);
  Cell b = parse_one(cell.substr(semi + 1, close - semi - 1), line, col);
  if (f.word != Word::F || (b.word != Word::B && b.word != Word::I && b.word != Word::BW))
    throw UsageError("PyTorch schedule CSV " + where(line, col) + ": '" + excerpt(cell) +
                     "' pairs other than a forward and a backward: OVERLAP_F_B is (<stage>F<mb>;<stage>B<mb>)");
  f.paired = true;
  return {f, b};
}

// Splits one CSV line into cells (Python csv quoting: "a,b" and "" inside quotes), trimming spaces.
std::vector<std::string> split_cells(const std::string& line, int line_no) {
  std::vector<std::string> out;
  std::string cur;
  bool quoted = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char ch = line[i];
    if (quoted) {
      if (ch == '"' && i + 1 < line.size() && line[i + 1] == '"') cur += '"', ++i;
      else if (ch == '"') quoted = false;
      else cur += ch;
    } else if (ch == '"') {
      quoted = true;
    } else if (ch == ',') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (quoted)
    throw UsageError("PyTorch schedule CSV line " + std::to_string(line_no) + ": a quoted cell is not closed");
  out.push_back(cur);
  for (std::string& c : out) {
    const auto a = c.find_first_not_of(" \t"), b = c.find_last_not_of(" \t");
    c = a == std::string::npos ? std::string() : c.substr(a, b - a + 1);
  }
  return out;
}

ActionKind kind_of(Word w, TorchLetters letters) {
  switch (w) {
    case Word::F: return ActionKind::F;
    case Word::I: return ActionKind::B;
    case Word::W: return ActionKind::W;
    case Word::B: return letters == TorchLetters::legacy ? ActionKind::B : ActionKind::BW;
    case Word::BW: return ActionKind::BW;
    case Word::SendF: return ActionKind::SendAct;
    case Word::RecvF: return ActionKind::RecvAct;
    case Word::SendB: return ActionKind::SendGrad;
    case Word::RecvB: return ActionKind::RecvGrad;
    default: break;
  }
  throw std::logic_error("torch_csv: no kind for an ignored word");
}

}  // namespace

TorchLetters parse_torch_letters(const std::string& name) {
  if (name == "detect") return TorchLetters::detect;
  if (name == "current") return TorchLetters::current;
  if (name == "legacy") return TorchLetters::legacy;
  throw UsageError("unknown PyTorch letter set '" + name +
                   "': use current (I input gradient, B full backward), legacy (B input gradient, BW full backward) "
                   "or detect");
}

const char* to_string(TorchLetters letters) {
  switch (letters) {
    case TorchLetters::detect: return "detect";
    case TorchLetters::current: return "current";
    case TorchLetters::legacy: return "legacy";
  }
  return "?";
}

TorchCsvRead from_torch_csv(const std::string& text, const TorchCsvReadOptions& options) {
  // Rows, as Python's csv reader sees them: every line is a rank (an empty line a rank with nothing to
  // do); a final line break does not start another row.
  std::vector<std::vector<Cell>> rows;
  std::size_t start = text.size() - skip_utf8_bom(text).size();  // a leading byte order mark is no cell
  int line_no = 0, skipped = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    start = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::vector<Cell> row;
    int col = 0;
    for (const std::string& cell : split_cells(line, line_no)) {
      ++col;
      if (cell.empty()) continue;  // an idle slot
      for (const Cell& c : parse_cell(cell, line_no, col)) {
        if (ignored(c.word)) {
          ++skipped;
          continue;
        }
        row.push_back(c);
      }
    }
    rows.push_back(std::move(row));
  }
  if (rows.empty())
    throw UsageError("PyTorch schedule CSV has no rows: write one line per rank, e.g. '0F0,0B0' for one rank");

  TorchCsvRead out;
  // The letter set.
  const Cell *first_i = nullptr, *first_bw = nullptr, *first_w = nullptr, *first_b = nullptr;
  for (const auto& row : rows)
    for (const Cell& c : row) {
      if (c.word == Word::I && !first_i) first_i = &c;
      if (c.word == Word::BW && !first_bw) first_bw = &c;
      if (c.word == Word::W && !first_w) first_w = &c;
      if (c.word == Word::B && !first_b) first_b = &c;
    }
  if (first_i && first_bw)
    throw UsageError("PyTorch schedule CSV mixes its two letter sets: " + where(first_i->line, first_i->col) +
                     " uses I (current letters: I input gradient, B full backward) but " +
                     where(first_bw->line, first_bw->col) +
                     " uses BW (older letters: B input gradient, BW full backward); use one set");
  TorchLetters letters = options.letters;
  if (letters == TorchLetters::detect) letters = (first_bw || (first_w && !first_i)) ? TorchLetters::legacy : TorchLetters::current;
  if (letters == TorchLetters::current && first_bw)
    throw UsageError("PyTorch schedule CSV " + where(first_bw->line, first_bw->col) +
                     " uses BW, which only the older letters have: read it with the legacy letters");
  if (letters == TorchLetters::legacy && first_i)
    throw UsageError("PyTorch schedule CSV " + where(first_i->line, first_i->col) +
                     " uses I, which only the current letters have: read it with the current letters");
  out.letters = letters;

  Schedule& s = out.schedule;
  s.name = options.name;
  s.ranks = static_cast<int>(rows.size());
  long max_stage = -1, max_micro = -1;
  for (const auto& row : rows)
    for (const Cell& c : row) {
      max_stage = std::max<long>(max_stage, c.stage);
      max_micro = std::max<long>(max_micro, c.micro);
    }
  if (max_micro < 0)
    throw UsageError("PyTorch schedule CSV has no actions with a micro-batch: a schedule needs at least one forward, "
                     "e.g. 0F0");
  s.stages = options.stages > 0 ? options.stages : static_cast<int>(max_stage + 1);
  s.microbatches = static_cast<int>(max_micro + 1);
  if (s.stages > kMaxStages || s.microbatches > kMaxMicrobatches ||
      static_cast<long>(s.stages) * s.microbatches > kMaxCells)
    throw UsageError("PyTorch schedule CSV has " + std::to_string(s.stages) + " stages and " +
                     std::to_string(s.microbatches) + " micro-batches (the largest numbers in its cells): the limits are " +
                     std::to_string(kMaxStages) + " stages, " + std::to_string(kMaxMicrobatches) + " micro-batches and " +
                     std::to_string(kMaxCells) + " (stage, micro-batch) pairs; check the numbers");
  if (options.stages > 0 && max_stage >= options.stages)
    throw UsageError("PyTorch schedule CSV names stage " + std::to_string(max_stage) + " but the schedule was given " +
                     std::to_string(options.stages) + " stages (0.." + std::to_string(options.stages - 1) +
                     "): give more stages or leave the count to the file");
  s.microbatches_per_step = s.microbatches;
  s.synchronous = true;

  if (!options.stage_rank.empty()) {
    if (static_cast<int>(options.stage_rank.size()) != s.stages)
      throw UsageError("the stage-to-rank map lists " + std::to_string(options.stage_rank.size()) +
                       " ranks but the schedule has " + std::to_string(s.stages) + " stages: give one rank per stage");
    for (int r : options.stage_rank)
      if (r < 0 || r >= s.ranks)
        throw UsageError("the stage-to-rank map names rank " + std::to_string(r) + " but the file has " +
                         std::to_string(s.ranks) + " rows (ranks 0.." + std::to_string(s.ranks - 1) + ")");
    s.stage_rank = options.stage_rank;
  } else {
    // Each stage belongs to the first row that names it; a stage no row names goes to stage % ranks (the
    // validator then reports its missing actions). A stage named on two rows is left to the validator,
    // which marks the misplaced cell.
    s.stage_rank.assign(static_cast<std::size_t>(s.stages), -1);
    for (int r = 0; r < s.ranks; ++r)
      for (const Cell& c : rows[static_cast<std::size_t>(r)])
        if (s.stage_rank[static_cast<std::size_t>(c.stage)] < 0) s.stage_rank[static_cast<std::size_t>(c.stage)] = r;
    for (int st = 0; st < s.stages; ++st)
      if (s.stage_rank[static_cast<std::size_t>(st)] < 0) s.stage_rank[static_cast<std::size_t>(st)] = st % s.ranks;
  }

  s.actions.resize(rows.size());
  for (std::size_t r = 0; r < rows.size(); ++r)
    for (const Cell& c : rows[r]) {
      const ActionKind k = kind_of(c.word, letters);
      out.with_communication |= is_comm(k);
      s.actions[r].push_back(Action{k, c.stage, c.micro});
      s.actions[r].back().paired = c.paired;
    }
  if (skipped > 0)
    out.notes.push_back("skipped " + std::to_string(skipped) +
                        " UNSHARD/RESHARD/REDUCE_GRAD cell(s): FSDP and gradient-reduction steps have no place in "
                        "pipetrain's schedule IR");
  if (options.add_steps) {
    for (int r = 0; r < s.ranks; ++r)
      for (int st = 0; st < s.stages; ++st)
        if (s.stage_rank[static_cast<std::size_t>(st)] == r)
          s.actions[static_cast<std::size_t>(r)].push_back(Action{ActionKind::Step, st, 0});
    out.notes.push_back("added one optimizer step per stage at the end of its rank's row (PyTorch's schedule leaves "
                        "the step to the caller)");
  }
  return out;
}

TorchCsvRead load_torch_csv_file(const std::string& path, const TorchCsvReadOptions& options) {
  const std::string text = read_file_capped(path, "schedule file", kMaxScheduleFileBytes);
  try {
    return from_torch_csv(text, options);
  } catch (const UsageError& e) {
    throw UsageError("schedule file '" + path + "': " + e.what());
  }
}

namespace {

std::string torch_cell(const Action& a, TorchLetters letters) {
  std::string kind;
  switch (a.kind) {
    case ActionKind::F: kind = "F"; break;
    case ActionKind::B: kind = letters == TorchLetters::legacy ? "B" : "I"; break;
    case ActionKind::W: kind = "W"; break;
    case ActionKind::BW: kind = letters == TorchLetters::legacy ? "BW" : "B"; break;
    case ActionKind::SendAct: kind = "SEND_F"; break;
    case ActionKind::RecvAct: kind = "RECV_F"; break;
    case ActionKind::SendGrad: kind = "SEND_B"; break;
    case ActionKind::RecvGrad: kind = "RECV_B"; break;
    case ActionKind::Step: throw std::logic_error("torch_csv: steps are dropped before writing");
  }
  return std::to_string(a.stage) + kind + std::to_string(a.index);
}

}  // namespace

std::string to_torch_csv(const Schedule& s, const TorchCsvWriteOptions& options) {
  if (options.letters == TorchLetters::detect)
    throw UsageError("writing a PyTorch schedule CSV needs a letter set: current or legacy, not detect");
  if (s.replicated())
    throw UsageError("schedule '" + s.name +
                     "' replicates stages over several ranks; PyTorch's schedule CSV gives every stage one rank");
  if (!s.synchronous)  // --steps 1 does not help: the schedule itself never flushes
    throw UsageError("schedule '" + s.name + "' is asynchronous (it steps without a flush), and PyTorch's schedule "
                     "CSV holds one synchronous step: choose a synchronous schedule (gpipe, 1f1b, zb-h1, ...), or keep "
                     "pipetrain's CSV (--format csv)");
  if (s.steps() != 1 || s.microbatches_per_step != s.microbatches)
    throw UsageError("schedule '" + s.name + "' has " + std::to_string(s.steps()) +
                     " optimizer steps; PyTorch's schedule CSV holds one synchronous step: generate it with one step "
                     "(--steps 1)");
  bool skip_transfer = false;
  for (const auto& row : s.actions)
    for (const Action& a : row) skip_transfer |= a.peer >= 0;
  if (!s.skips.empty() || skip_transfer)
    throw UsageError("schedule '" + s.name +
                     "' has skip routes; PyTorch's schedule CSV sends only between neighbouring stages and cannot "
                     "name a skip's peer: write it without --skip, or keep pipetrain's own CSV (--format csv)");
  bool lowered = false;
  for (const auto& row : s.actions)
    for (const Action& a : row) lowered |= is_comm(a.kind);

  std::vector<std::vector<std::string>> cells(static_cast<std::size_t>(s.ranks));
  if (lowered || !options.idle_cells) {
    // A paired forward and the rank's next compute action share one cell, (F;B)OVERLAP_F_B, when nothing
    // runs between them (in a lowered schedule the forward's sends come first: then two cells).
    for (int r = 0; r < s.ranks; ++r) {
      std::vector<Action> row;
      for (const Action& a : s.actions[static_cast<std::size_t>(r)])
        if (a.kind != ActionKind::Step) row.push_back(a);
      auto& out = cells[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < row.size(); ++i) {
        if (row[i].paired && row[i].kind == ActionKind::F && i + 1 < row.size() && is_compute(row[i + 1].kind)) {
          out.push_back("(" + torch_cell(row[i], options.letters) + ";" + torch_cell(row[i + 1], options.letters) +
                        ")OVERLAP_F_B");
          ++i;
        } else {
          out.push_back(torch_cell(row[i], options.letters));
        }
      }
    }
  } else {
    // Lock step: an action's column is one past its rank's previous action and one past the column of
    // every action on another rank that made a token it needs. Placed by a dry run over the ranks, as
    // the validator's (a schedule that does not validate may be refused here).
    std::unordered_map<std::size_t, std::pair<long, int>> made;  // token -> (column, rank) of its maker
    std::vector<std::size_t> ptr(static_cast<std::size_t>(s.ranks), 0);
    std::vector<long> next_col(static_cast<std::size_t>(s.ranks), 0);
    std::size_t remaining = 0;
    for (const auto& row : s.actions) remaining += row.size();
    while (remaining > 0) {
      bool progressed = false;
      for (int r = 0; r < s.ranks; ++r) {
        const auto& row = s.actions[static_cast<std::size_t>(r)];
        auto& p = ptr[static_cast<std::size_t>(r)];
        while (p < row.size()) {
          const Action& a = row[p];
          long col = next_col[static_cast<std::size_t>(r)];
          bool ready = true;
          for (const Token& t : required_tokens(a, s.stages)) {
            if (t.stage < 0 || t.stage >= s.stages || t.micro < 0 || t.micro >= s.microbatches) continue;
            const auto m = made.find(token_index(t, s.stages, s.microbatches));
            if (m == made.end()) {
              ready = false;
              break;
            }
            if (m->second.second != r) col = std::max(col, m->second.first + 1);
          }
          if (!ready) break;
          if (a.kind != ActionKind::Step) {
            auto& out_row = cells[static_cast<std::size_t>(r)];
            while (static_cast<long>(out_row.size()) < col) out_row.emplace_back();
            out_row.push_back(torch_cell(a, options.letters));
            next_col[static_cast<std::size_t>(r)] = col + 1;
            if (auto t = produced_token(a)) {
              if (t->stage >= 0 && t->stage < s.stages && t->micro >= 0 && t->micro < s.microbatches) {
                made[token_index(*t, s.stages, s.microbatches)] = {col, r};
              }
            }
          }
          ++p;
          --remaining;
          progressed = true;
        }
      }
      if (!progressed)
        throw UsageError("schedule '" + s.name +
                         "' cannot be laid out in lock step: some action waits for data no rank makes first (run "
                         "pipetrain's validator on it)");
    }
  }
  std::string out;
  for (const auto& row : cells) {
    for (std::size_t i = 0; i < row.size(); ++i) out += (i ? "," : "") + row[i];
    out += '\n';
  }
  return out;
}

}  // namespace pipetrain

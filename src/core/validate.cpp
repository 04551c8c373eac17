#include "pipetrain/core/validate.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <map>
#include <stdexcept>
#include <set>
#include <sstream>

#include "pipetrain/core/dependencies.h"
#include "pipetrain/core/skip.h"
#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"

namespace pipetrain {

std::string render_grid(const Schedule& s, const std::vector<GridCell>& marked) {
  std::size_t ncols = 0, width = 3;
  for (const auto& row : s.actions) {
    ncols = std::max(ncols, row.size());
    for (const Action& a : row) width = std::max(width, to_string(a).size());
  }
  width += 3;  // room for the [..] marks and one space
  constexpr std::size_t kMaxCols = 24;
  std::size_t first = 0, last = ncols;
  if (ncols > kMaxCols) {
    std::size_t focus = marked.empty() ? 0 : static_cast<std::size_t>(marked.front().pos);
    first = focus > kMaxCols / 2 ? focus - kMaxCols / 2 : 0;
    last = std::min(ncols, first + kMaxCols);
    first = last - kMaxCols;
  }
  auto is_marked = [&](int r, std::size_t c) {
    return std::any_of(marked.begin(), marked.end(),
                       [&](const GridCell& g) { return g.rank == r && static_cast<std::size_t>(g.pos) == c; });
  };
  std::ostringstream out;
  out << "step x rank grid" << (marked.empty() ? "" : " ([..] marks the offending action)")
      << (first > 0 || last < ncols ? ", steps " + std::to_string(first) + ".." + std::to_string(last - 1) +
                                           " of " + std::to_string(ncols)
                                     : std::string())
      << ":\n";
  // The rows as they are (a malformed schedule's `ranks` may disagree with them: this draws its error).
  const int rows = static_cast<int>(s.actions.size());
  const std::string label = "rank " + std::to_string(std::max(rows, 1) - 1) + " ";
  out << std::string(label.size() + 1, ' ') << (first > 0 ? "... " : "");
  for (std::size_t c = first; c < last; ++c) {
    std::string num = std::to_string(c);
    out << num << std::string(width - num.size(), ' ');
  }
  out << '\n';
  for (int r = 0; r < rows; ++r) {
    std::string name = "rank " + std::to_string(r);
    out << name << std::string(label.size() - name.size(), ' ') << (first > 0 ? "... " : "");
    const auto& row = s.actions[static_cast<std::size_t>(r)];
    for (std::size_t c = first; c < last && c < row.size(); ++c) {
      const std::string text = to_string(row[c]);
      const std::string cell = is_marked(r, c) ? "[" + text + "]" : " " + text + " ";
      out << cell << std::string(width - cell.size(), ' ');
    }
    if (row.size() > last) out << "...";
    out << '\n';
  }
  return out.str();
}

namespace {

[[noreturn]] void fail(const Schedule& s, const std::string& what, const std::vector<GridCell>& cells = {}) {
  throw ScheduleError("invalid schedule '" + s.name + "': " + what + "\n" + render_grid(s, cells));
}

std::string token_text(const Token& t) {
  return std::string(t.kind == Token::Act ? "the activation of stage " : "the input gradient of stage ") +
         std::to_string(t.stage) + " micro-batch " + std::to_string(t.micro);
}

void check_structure(const Schedule& s) {
  auto bad = [&](const std::string& what) { throw ScheduleError("invalid schedule '" + s.name + "': " + what); };
  if (s.ranks < 1) bad("ranks must be >= 1, got " + std::to_string(s.ranks));
  if (s.stages < 1) bad("stages must be >= 1, got " + std::to_string(s.stages));
  if (s.microbatches < 1) bad("micro-batches must be >= 1, got " + std::to_string(s.microbatches));
  if (s.microbatches_per_step < 1)
    bad("micro-batches per step must be >= 1, got " + std::to_string(s.microbatches_per_step));
  if (static_cast<int>(s.actions.size()) != s.ranks)
    bad("has " + std::to_string(s.actions.size()) + " action rows for " + std::to_string(s.ranks) +
        " ranks: give one row per rank");
  if (static_cast<int>(s.stage_rank.size()) != s.stages)
    bad("stage_rank has " + std::to_string(s.stage_rank.size()) + " entries for " + std::to_string(s.stages) +
        " stages");
  for (int st = 0; st < s.stages; ++st) {
    const int r = s.stage_rank[static_cast<std::size_t>(st)];
    if (r < 0 || r >= s.ranks)
      bad("stage " + std::to_string(st) + " is owned by rank " + std::to_string(r) + " but ranks are 0.." +
          std::to_string(s.ranks - 1));
  }
  if (!s.replicated()) return;
  if (static_cast<int>(s.stage_replicas.size()) != s.stages)
    bad("stage_replicas has " + std::to_string(s.stage_replicas.size()) + " entries for " + std::to_string(s.stages) +
        " stages");
  for (int st = 0; st < s.stages; ++st) {
    const auto& reps = s.stage_replicas[static_cast<std::size_t>(st)];
    if (reps.empty()) bad("stage " + std::to_string(st) + " has no replicas: give it at least one rank");
    if (reps.front() != s.stage_rank[static_cast<std::size_t>(st)])
      bad("stage " + std::to_string(st) + "'s owner (stage_rank) is rank " +
          std::to_string(s.stage_rank[static_cast<std::size_t>(st)]) + " but its first replica is rank " +
          std::to_string(reps.front()));
    for (std::size_t k = 0; k < reps.size(); ++k) {
      if (reps[k] < 0 || reps[k] >= s.ranks)
        bad("stage " + std::to_string(st) + " has a replica on rank " + std::to_string(reps[k]) + " but ranks are 0.." +
            std::to_string(s.ranks - 1));
      if (std::find(reps.begin(), reps.begin() + static_cast<std::ptrdiff_t>(k), reps[k]) != reps.begin() + static_cast<std::ptrdiff_t>(k))
        bad("stage " + std::to_string(st) + " lists rank " + std::to_string(reps[k]) + " twice among its replicas");
    }
  }
}

// Actions are unique except optimizer steps, which every replica of a stage runs: steps are keyed by
// their rank, everything else by rank -1. Held as the cells sorted by their actions' keys (a map took ~70 bytes
// per action: 176 MB at 512 stages x 2048 micro-batches; this takes 8), looked up by binary search.
class Where {
 public:
  using Key = std::pair<Action, int>;
  explicit Where(const Schedule& s) : s_(&s) {}
  // The key of the action at a cell.
  Key key(const GridCell& c) const {
    const Action& a = s_->actions[static_cast<std::size_t>(c.rank)][static_cast<std::size_t>(c.pos)];
    return {a, a.kind == ActionKind::Step ? c.rank : -1};
  }
  const GridCell* find(const Key& k) const {
    auto it = std::lower_bound(cells_.begin(), cells_.end(), k, [&](const GridCell& c, const Key& x) { return key(c) < x; });
    return it != cells_.end() && !(k < key(*it)) ? &*it : nullptr;
  }
  std::size_t count(const Key& k) const { return find(k) ? 1 : 0; }
  const GridCell& at(const Key& k) const {
    const GridCell* c = find(k);
    if (!c) throw std::out_of_range("validate: no such action");
    return *c;
  }
  // Cells in key order (8 bytes per action; the keys are read from the schedule).
  std::vector<GridCell> cells_;

 private:
  const Schedule* s_;
};
std::pair<Action, int> key_of(const Action& a, int rank) { return {a, a.kind == ActionKind::Step ? rank : -1}; }

bool scanned_before(const GridCell& a, const GridCell& b) { return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos; }

// Where each action sits; fails on out-of-range actions, wrong owners and duplicates, reporting the first
// problem in row order (rank, then position) as a scan that stopped at it would.
Where locate(const Schedule& s) {
  Where where(s);
  std::size_t total = 0;
  for (const auto& row : s.actions) total += row.size();
  where.cells_.reserve(total);
  std::exception_ptr first_error;
  GridCell error_at{std::numeric_limits<int>::max(), std::numeric_limits<int>::max()};
  for (int r = 0; r < s.ranks && !first_error; ++r) {
    const auto& row = s.actions[static_cast<std::size_t>(r)];
    for (int pos = 0; pos < static_cast<int>(row.size()); ++pos) {
      const Action& a = row[static_cast<std::size_t>(pos)];
      try {
        const std::string text = a.stage >= 0 && a.stage < s.stages && a.peer < 0 && !is_comm(a.kind) &&
                                         a.kind != ActionKind::Step && a.index >= 0 && a.index < s.microbatches &&
                                         s.rank_of(a.stage, a.index) == r
                                     ? std::string()  // the checks below pass: no text needed
                                     : to_string(a);
        if (!text.empty()) {
        if (a.peer >= 0 && (!is_comm(a.kind) || a.peer >= s.stages))
          fail(s, text + " names peer stage " + std::to_string(a.peer) + " but only transfers name a peer, a stage 0.." +
                      std::to_string(s.stages - 1),
               {{r, pos}});
        if (a.peer >= 0) {
          try {
            skip_carried(s, a);
          } catch (const UsageError& e) {
            fail(s, e.what(), {{r, pos}});
          }
        }
        if (a.stage < 0 || a.stage >= s.stages)
          fail(s, text + " names stage " + std::to_string(a.stage) + " but the schedule has " +
                      std::to_string(s.stages) + " stages (0.." + std::to_string(s.stages - 1) + ")",
               {{r, pos}});
        const int limit = a.kind == ActionKind::Step ? s.steps() : s.microbatches;
        if (a.index < 0 || a.index >= limit)
          fail(s, text + " names " + (a.kind == ActionKind::Step ? "step " : "micro-batch ") + std::to_string(a.index) +
                      " but the schedule has " + std::to_string(limit) +
                      (a.kind == ActionKind::Step ? " steps" : " micro-batches") + " (0.." + std::to_string(limit - 1) +
                      ")",
               {{r, pos}});
        const bool needs_next = a.kind == ActionKind::SendAct || a.kind == ActionKind::RecvGrad;
        const bool needs_prev = a.kind == ActionKind::RecvAct || a.kind == ActionKind::SendGrad;
        if (a.peer < 0 && ((needs_next && a.stage + 1 >= s.stages) || (needs_prev && a.stage == 0)))
          fail(s, text + " transfers to or from a stage that does not exist", {{r, pos}});
        if (is_comm(a.kind) && s.rank_of(matching_comm(a).stage, a.index) == r)
          fail(s, text + " is a transfer between stages " + std::to_string(a.stage) + " and " +
                      std::to_string(matching_comm(a).stage) + ", which are both on rank " + std::to_string(r) +
                      ": remove it",
               {{r, pos}});
        if (a.kind == ActionKind::Step) {
          if (!s.holds(r, a.stage))
            fail(s, text + " is an optimizer step of stage " + std::to_string(a.stage) + ", which rank " +
                        std::to_string(r) + " does not hold: move it to rank " + std::to_string(s.rank_of(a.stage)) +
                        "'s row",
                 {{r, pos}});
        } else {
          const int owner = s.rank_of(a.stage, a.index);
          if (owner != r)
            fail(s, text + " belongs to stage " + std::to_string(a.stage) + (s.replicated() ? " micro-batch " + std::to_string(a.index) : std::string()) +
                        ", which rank " + std::to_string(owner) + (s.replicated() ? " runs" : " owns") + ", but it is on rank " + std::to_string(r) +
                        ": move it to rank " + std::to_string(owner) + "'s row",
                 {{r, pos}});
        }
        }
      } catch (...) {
        first_error = std::current_exception();
        error_at = GridCell{r, pos};
        break;
      }
      where.cells_.push_back(GridCell{r, pos});
    }
  }
  std::stable_sort(where.cells_.begin(), where.cells_.end(),
                   [&](const GridCell& x, const GridCell& y) { return where.key(x) < where.key(y); });
  // The first duplicate in row order: equal neighbours, the later one earliest.
  const GridCell* dup_first = nullptr;
  const GridCell* dup_second = nullptr;
  for (std::size_t k = 1; k < where.cells_.size(); ++k) {
    const GridCell& x = where.cells_[k - 1];
    const GridCell& y = where.cells_[k];
    if (where.key(x) < where.key(y)) continue;
    if (!dup_second || scanned_before(y, *dup_second)) dup_first = &x, dup_second = &y;
  }
  if (dup_second && scanned_before(*dup_second, error_at))
    fail(s, to_string(where.key(*dup_second).first) + " appears twice: every action runs exactly once",
         {*dup_first, *dup_second});
  if (first_error) std::rethrow_exception(first_error);
  return where;
}

// Paired slots: a pair opens at a forward and closes at the rank's next compute action, which must be a
// backward (BW or B) of another stage.
void check_pairs(const Schedule& s) {
  for (int r = 0; r < s.ranks; ++r) {
    const auto& row = s.actions[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < row.size(); ++i) {
      if (!row[i].paired) continue;
      const std::string text = to_string(row[i]);
      const int pos = static_cast<int>(i);
      if (row[i].kind != ActionKind::F)
        fail(s, text + " opens a paired slot, but a pair is a forward and a backward: pair a forward with the backward "
                       "that follows it",
             {{r, pos}});
      std::size_t j = i + 1;
      while (j < row.size() && !is_compute(row[j].kind)) ++j;
      if (j == row.size())
        fail(s, text + " opens a paired slot that nothing closes: follow it with a backward of another stage", {{r, pos}});
      const Action& b = row[j];
      if ((b.kind != ActionKind::BW && b.kind != ActionKind::B) || b.stage == row[i].stage)
        fail(s, "the paired slot (" + text + ";" + to_string(b) + ") must pair a forward with a backward (BW or B) of "
                    "another stage",
             {{r, pos}, {r, static_cast<int>(j)}});
    }
  }
}

void check_complete(const Schedule& s, const Where& where) {
  auto has = [&](ActionKind k, int st, int i) { return where.count({Action{k, st, i}, -1}) > 0; };
  auto at = [&](ActionKind k, int st, int i) { return where.at({Action{k, st, i}, -1}); };
  bool has_steps = false, lowered = false;
  for (const GridCell& cell : where.cells_) {
    const Action& a = where.key(cell).first;
    has_steps |= a.kind == ActionKind::Step;
    lowered |= is_comm(a.kind);
  }
  for (int st = 0; st < s.stages; ++st) {
    for (int i = 0; i < s.microbatches; ++i) {
      const std::string owner = " (rank " + std::to_string(s.rank_of(st, i)) + ")";
      auto text = [&](ActionKind k) { return to_string(Action{k, st, i}); };
      if (!has(ActionKind::F, st, i))
        fail(s, "missing " + text(ActionKind::F) + ": stage " + std::to_string(st) + owner +
                    " must forward micro-batch " + std::to_string(i) + " once");
      const bool bw = has(ActionKind::BW, st, i), b = has(ActionKind::B, st, i), w = has(ActionKind::W, st, i);
      if (bw && (b || w))
        fail(s, "stage " + std::to_string(st) + " micro-batch " + std::to_string(i) +
                    " has both a fused backward " + text(ActionKind::BW) + " and a split one: use BW, or B and W",
             {at(ActionKind::BW, st, i), b ? at(ActionKind::B, st, i) : at(ActionKind::W, st, i)});
      if (!bw && !b)
        fail(s, "missing the backward of stage " + std::to_string(st) + " micro-batch " + std::to_string(i) + owner +
                    ": add " + text(ActionKind::BW) + ", or " + text(ActionKind::B) + " and " + text(ActionKind::W));
      if (b && !w)
        fail(s, text(ActionKind::B) + " has no matching " + text(ActionKind::W) + ": add the weight-gradient pass",
             {at(ActionKind::B, st, i)});
      if (w && !b)
        fail(s, text(ActionKind::W) + " has no matching " + text(ActionKind::B) + ": add the input-gradient pass",
             {at(ActionKind::W, st, i)});
      if (lowered && st + 1 < s.stages && s.rank_of(st, i) != s.rank_of(st + 1, i)) {
        for (ActionKind k : {ActionKind::SendAct, ActionKind::SendGrad}) {
          const Action send = k == ActionKind::SendAct ? Action{k, st, i} : Action{k, st + 1, i};
          const Action recv = matching_comm(send);
          for (const Action& c : {send, recv})
            if (!where.count({c, -1}))
              fail(s, "this lowered schedule misses " + to_string(c) + " on rank " +
                          std::to_string(s.rank_of(c.stage, c.index)) + " (every transfer between ranks needs a send and a "
                          "receive)");
        }
      }
    }
    for (std::size_t k = 0; lowered && k < s.skips.size(); ++k) {
      if (s.skips[k].from_stage != st) continue;
      for (int i = 0; i < s.microbatches; ++i) {
        if (s.rank_of(st, i) == s.rank_of(s.skips[k].to_stage, i)) continue;
        for (bool grad : {false, true}) {
          const Action send = skip_send(s, SkipToken{static_cast<int>(k), grad, i});
          for (const Action& c : {send, matching_comm(send)})
            if (!where.count({c, -1}))
              fail(s, "this lowered schedule misses the skip transfer " + to_string(c) + " on rank " +
                          std::to_string(s.rank_of(c.stage, c.index)) + " (skip route " + std::to_string(st) + ":" +
                          std::to_string(s.skips[k].to_stage) + " moves every micro-batch's skip and its gradient "
                          "with a send and a receive)");
        }
      }
    }
    if (has_steps)
      for (int k = 0; k < s.steps(); ++k)
        for (int q = 0; q < s.replicas_of(st); ++q) {
          const int r = s.replicated() ? s.stage_replicas[static_cast<std::size_t>(st)][static_cast<std::size_t>(q)] : s.rank_of(st);
          if (!where.count({Action{ActionKind::Step, st, k}, r}))
            fail(s, "missing optimizer step " + to_string(Action{ActionKind::Step, st, k}) + " (rank " + std::to_string(r) +
                        "): a schedule with steps needs one per stage" + (s.replicated() ? ", replica" : "") + " and step");
        }
  }
}

void check_local_order(const Schedule& s, const Where& where) {
  int rank = 0;  // the rank of the micro-batch being checked (its replica's optimizer steps)
  // `why` as a C string: built only for the message (a std::string per call was 40% of validate()).
  auto before = [&](const Action& x, const Action& y, const char* why) {
    const GridCell* ix = where.find(key_of(x, rank));
    const GridCell* iy = where.find(key_of(y, rank));
    if (!ix || !iy) return;
    if ((*ix).pos > (*iy).pos)
      fail(s, to_string(y) + " runs before " + to_string(x) + " on rank " + std::to_string((*iy).rank) + ": " +
                  why,
           {(*iy), (*ix)});
  };
  for (int st = 0; st < s.stages; ++st)
    for (int i = 0; i < s.microbatches; ++i) {
      rank = s.rank_of(st, i);
      before({ActionKind::F, st, i}, {ActionKind::BW, st, i}, "a backward needs its forward's activations");
      before({ActionKind::F, st, i}, {ActionKind::B, st, i}, "a backward needs its forward's activations");
      before({ActionKind::B, st, i}, {ActionKind::W, st, i}, "W needs what B saves for it");
      const int k = s.step_of(i);
      for (ActionKind kind : {ActionKind::BW, ActionKind::B, ActionKind::W})
        before({kind, st, i}, {ActionKind::Step, st, k},
               "the optimizer step must follow every backward of its micro-batches");
      if (s.synchronous && k > 0)
        before({ActionKind::Step, st, k - 1}, {ActionKind::F, st, i},
               "in a synchronous schedule a step's forwards wait for the previous optimizer step (flush)");
    }
}

void dry_run(const Schedule& s) {
  bool lowered = false;
  for (const auto& row : s.actions)
    for (const Action& a : row) lowered |= is_comm(a.kind);
  const std::size_t ntok = 2 * static_cast<std::size_t>(s.stages) * static_cast<std::size_t>(s.microbatches);
  std::vector<int> maker(ntok, -1), receiver(ntok, -1);
  std::vector<int> skip_maker(skip_token_count(s), -1), skip_receiver(skip_token_count(s), -1);
  auto skip_usable = [&](const SkipToken& t, int r) {
    const std::size_t ti = skip_index(t, s.microbatches);
    if (skip_maker[ti] < 0) return false;
    return !lowered || skip_maker[ti] == r || skip_receiver[ti] == r;
  };
  std::vector<std::size_t> ptr(static_cast<std::size_t>(s.ranks), 0);
  auto usable = [&](const Token& t, int r) {
    const std::size_t ti = token_index(t, s.stages, s.microbatches);
    if (maker[ti] < 0) return false;
    return !lowered || maker[ti] == r || receiver[ti] == r;
  };
  auto head = [&](int r) -> const Action* {
    const auto& row = s.actions[static_cast<std::size_t>(r)];
    return ptr[static_cast<std::size_t>(r)] < row.size() ? &row[ptr[static_cast<std::size_t>(r)]] : nullptr;
  };
  std::size_t remaining = 0;
  for (const auto& row : s.actions) remaining += row.size();
  // Sweeps alternate direction: forwards flow to higher ranks and backwards to lower ones, so one
  // direction only moved a backward one rank per sweep (gpipe at p = 8000 took 0.94 s, p = 100,000 did
  // not finish in minutes). Any order reaches the same fixpoint: an action, once ready, stays ready.
  bool upwards = false;
  while (remaining > 0) {
    bool progressed = false;
    upwards = !upwards;
    for (int k = 0; k < s.ranks; ++k) {
      const int r = upwards ? k : s.ranks - 1 - k;
      while (const Action* a = head(r)) {
        if (is_comm(a->kind)) {
          const Action peer_action = matching_comm(*a);
          const int q = s.rank_of(peer_action.stage, peer_action.index);
          const Action* peer = head(q);
          if (!peer || *peer != peer_action) break;
          const bool sending = a->kind == ActionKind::SendAct || a->kind == ActionKind::SendGrad;
          if (const auto st = skip_carried(s, *a)) {
            const int sender = sending ? r : q;
            if (!skip_usable(*st, sender))
              fail(s, to_string(sending ? *a : peer_action) + " sends the skip " + (st->grad ? "gradient" : "activation") +
                          " of micro-batch " + std::to_string(st->micro) + " before rank " + std::to_string(sender) +
                          " has made it: move the send after the action that makes it",
                   {{sender, static_cast<int>(ptr[static_cast<std::size_t>(sender)])}});
            skip_receiver[skip_index(*st, s.microbatches)] = sending ? q : r;
            ++ptr[static_cast<std::size_t>(r)];
            ++ptr[static_cast<std::size_t>(q)];
            remaining -= 2;
            progressed = true;
            continue;
          }
          const Token t = *carried_token(*a);
          const int sender = sending ? r : q;
          if (!usable(t, sender))
            fail(s, to_string(sending ? *a : peer_action) + " sends " + token_text(t) + " before rank " +
                        std::to_string(sender) + " has made it: move the send after the action that makes it",
                 {{sender, static_cast<int>(ptr[static_cast<std::size_t>(sender)])}});
          receiver[token_index(t, s.stages, s.microbatches)] = sending ? q : r;
          ++ptr[static_cast<std::size_t>(r)];
          ++ptr[static_cast<std::size_t>(q)];
          remaining -= 2;
          progressed = true;
          continue;
        }
        bool ready = true;
        for (const Token& t : required_tokens(*a, s.stages)) ready = ready && usable(t, r);
        for (const SkipToken& t : skip_needs(s, *a)) ready = ready && skip_usable(t, r);
        if (!ready) break;
        if (auto t = produced_token(*a)) maker[token_index(*t, s.stages, s.microbatches)] = r;
        for (const SkipToken& t : skip_makes(s, *a)) skip_maker[skip_index(t, s.microbatches)] = r;
        ++ptr[static_cast<std::size_t>(r)];
        --remaining;
        progressed = true;
      }
    }
    if (progressed) continue;
    std::ostringstream why;
    why << "deadlock: no rank can proceed" << (lowered ? " (sends and receives are blocking)" : "") << ".\n";
    std::vector<GridCell> heads;
    for (int r = 0; r < s.ranks; ++r) {
      const Action* a = head(r);
      if (!a) continue;
      heads.push_back({r, static_cast<int>(ptr[static_cast<std::size_t>(r)])});
      why << "  rank " << r << " is stuck at " << to_string(*a) << ": ";
      if (is_comm(a->kind)) {
        const Action peer_action = matching_comm(*a);
        const int q = s.rank_of(peer_action.stage, peer_action.index);
        const Action* peer = head(q);
        why << "waits for rank " << q << " to reach " << to_string(peer_action) << ", but rank " << q << " is at "
            << (peer ? to_string(*peer) : std::string("its end")) << "\n";
        continue;
      }
      for (const Token& t : required_tokens(*a, s.stages)) {
        if (usable(t, r)) continue;
        const std::size_t ti = token_index(t, s.stages, s.microbatches);
        why << "needs " << token_text(t);
        if (maker[ti] < 0)
          why << ", which has not been made yet";
        else
          why << ", made on rank " << maker[ti] << " but not received here (no receive before this action)";
        break;
      }
      for (const SkipToken& t : skip_needs(s, *a)) {
        if (skip_usable(t, r)) continue;
        const SkipEdge& route = s.skips[static_cast<std::size_t>(t.route)];
        why << " needs the skip " << (t.grad ? "gradient" : "activation") << " of route " << route.from_stage << ":"
            << route.to_stage << " micro-batch " << t.micro
            << (skip_maker[skip_index(t, s.microbatches)] < 0 ? ", which has not been made yet"
                                                                : ", which was not received here");
        break;
      }
      why << "\n";
    }
    fail(s, why.str(), heads);
  }
}

// What skips add to rank r's memory at action `a`, in the rank's order (§1.10): a skip from another rank
// from its receive (or, unlowered, from the consumer's F, by which it has arrived), one from the same
// rank from the producer's F; each until the consumer's W or BW of the micro-batch.
double skip_memory_delta(const Schedule& s, bool lowered, int r, const Action& a) {
  if (s.skips.empty()) return 0;
  double delta = 0;
  if (const auto t = skip_carried(s, a); t && !t->grad && a.kind == ActionKind::RecvAct)
    delta += s.skips[static_cast<std::size_t>(t->route)].size;
  if (a.kind == ActionKind::W || a.kind == ActionKind::BW)
    for (const SkipEdge& e : s.skips)
      if (e.to_stage == a.stage) delta -= e.size;
  if (a.kind != ActionKind::F) return delta;
  for (const SkipEdge& e : s.skips) {
    const bool local = s.rank_of(e.from_stage, a.index) == s.rank_of(e.to_stage, a.index);
    if (local && e.from_stage == a.stage) delta += e.size;
    if (!local && !lowered && e.to_stage == a.stage && s.rank_of(e.to_stage, a.index) == r) delta += e.size;
  }
  return delta;
}

// The largest activation memory any rank holds, at unit activations (one micro-batch of a rank's layers
// is 1, split over its v chunks), without skips: what "micro-batches in flight" compares.
double unit_peak(const Schedule& s) {
  const CostModel unit = CostModel::uniform(s.stages, StageCost{}, s.virtual_stages_per_rank());
  double peak = 0;
  for (const auto& row : s.actions) {
    double mem = 0;
    for (const Action& a : row) peak = std::max(peak, mem += unit.memory_delta(a));
  }
  return peak;
}

std::string number_text(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

// The advice of the memory-limit error: the built-in synchronous schedules that hold fewer micro-batches
// in flight than `s` at its ranks and micro-batches (generated to compare, at unit activations), the
// fewest first; or, when none does, the fixes that remain. zb-auto plans to any limit of at least one
// micro-batch.
std::string memory_advice(const Schedule& s, double limit) {
  const std::string generic = "raise the limit or use a schedule with fewer micro-batches in flight";
  if (s.replicated() || s.ranks < 1 || s.microbatches_per_step < 1) return generic;
  double own = 0;
  try {
    own = unit_peak(s);
  } catch (const std::exception&) {
    return generic;
  }
  std::vector<std::pair<double, std::string>> fewer;
  for (const std::string& name : schedule_names()) {
    if (name == s.name || name == "zb-auto") continue;  // zb-auto is named below: the limit is its target
    const ScheduleTraits t = schedule_traits(name);
    if (!t.synchronous) continue;
    GeneratorOptions g;
    g.ranks = s.ranks;
    g.microbatches = s.microbatches_per_step;
    g.virtual_stages = t.virtual_stages ? std::max(2, s.virtual_stages_per_rank()) : 1;
    try {
      const double peak = unit_peak(generate(name, g));
      if (peak < own - 1e-9) fewer.push_back({peak, name});
    } catch (const std::exception&) {
      // not built for these sizes (interleaved needs m a multiple of p, ...): not advised
    }
  }
  std::sort(fewer.begin(), fewer.end());
  const std::string sizes = "p=" + std::to_string(s.ranks) + ", m=" + std::to_string(s.microbatches_per_step);
  const std::string zb_auto = s.name == "zb-auto" || limit < 1 ? "" : ", or zb-auto, which plans to the limit";
  if (fewer.empty())
    return "no other built-in schedule holds fewer micro-batches in flight than this one's " + number_text(own) +
           " at " + sizes + ": raise the limit, or use fewer stages (the micro-batches in flight grow with p)" + zb_auto;
  std::string names;
  for (const auto& [peak, name] : fewer) names += (names.empty() ? "" : ", ") + name + " " + number_text(peak);
  return "raise the limit, or use a schedule with fewer micro-batches in flight than this one's " + number_text(own) +
         " (at " + sizes + ", equal activations: " + names + ")" + zb_auto;
}

void check_memory(const Schedule& s, const ValidateOptions& o) {
  if (!(o.memory_limit < std::numeric_limits<double>::infinity())) return;
  if (o.memory_limit <= 0)
    throw UsageError("memory limit " + std::to_string(o.memory_limit) + " must be > 0 micro-batches");
  const CostModel costs =
      o.costs.stage.empty() ? CostModel::uniform(s.stages, StageCost{}, s.virtual_stages_per_rank()) : o.costs;
  costs.check(s.stages);
  bool lowered = false;
  for (const auto& row : s.actions)
    for (const Action& x : row) lowered |= is_comm(x.kind);
  for (int r = 0; r < s.ranks; ++r) {
    double mem = 0;
    const auto& row = s.actions[static_cast<std::size_t>(r)];
    for (int pos = 0; pos < static_cast<int>(row.size()); ++pos) {
      const Action& a = row[static_cast<std::size_t>(pos)];
      mem += costs.memory_delta(a) + skip_memory_delta(s, lowered, r, a);
      if (mem > o.memory_limit + 1e-9) {
        std::ostringstream why;
        why << "rank " << r << " holds " << mem << " micro-batches of activations after "
            << to_string(row[static_cast<std::size_t>(pos)]) << ", above the memory limit " << o.memory_limit
            << ": " << memory_advice(s, o.memory_limit);
        fail(s, why.str(), {{r, pos}});
      }
    }
  }
}

}  // namespace

void check_ranges(const Schedule& s) {
  check_structure(s);
  for (int r = 0; r < s.ranks; ++r) {
    const auto& row = s.actions[static_cast<std::size_t>(r)];
    for (int pos = 0; pos < static_cast<int>(row.size()); ++pos) {
      const Action& a = row[static_cast<std::size_t>(pos)];
      const int limit = a.kind == ActionKind::Step ? s.steps() : s.microbatches;
      const bool needs_next = a.kind == ActionKind::SendAct || a.kind == ActionKind::RecvGrad;
      const bool needs_prev = a.kind == ActionKind::RecvAct || a.kind == ActionKind::SendGrad;
      if (a.stage >= 0 && a.stage < s.stages && a.index >= 0 && a.index < limit &&
          (a.peer < 0 ? !(needs_next && a.stage + 1 >= s.stages) && !(needs_prev && a.stage == 0)
                      : is_comm(a.kind) && a.peer < s.stages))
        continue;
      // The first action out of range: validate's own scan names it (and more) with the grid.
      locate(s);
      fail(s, to_string(a) + " is out of the schedule's range", {{r, pos}});
    }
  }
  check_skip_routes(s);
}

void validate(const Schedule& s, const ValidateOptions& o) {
  check_structure(s);
  check_skip_routes(s);
  const auto where = locate(s);
  check_pairs(s);
  check_complete(s, where);
  check_local_order(s, where);
  dry_run(s);
  check_memory(s, o);
}

}  // namespace pipetrain

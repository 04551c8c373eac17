// A schedule: for every rank, the ordered list of actions it runs. This is the data that the validator,
// the simulator and the runtime executor all consume.
//
// Ownership: a Schedule is a plain value. Generators return it; passes take it by const reference and
// return a new one. No thread-safety concerns beyond those of std::vector.
//
// Micro-batches are numbered globally over all optimizer steps of the schedule: with
// `microbatches_per_step = m`, micro-batch i belongs to step i / m. Asynchronous schedules such as
// PipeDream step after every micro-batch (`microbatches_per_step = 1`).
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

#include "pipetrain/core/action.h"

namespace pipetrain {

// A skip connection across stages (docs/ALGORITHMS.md §1.10): a layer of `from_stage` stashes a tensor
// that a layer of `to_stage` pops. The runtime sends it straight from one to the other and its gradient
// straight back. `size` is what one micro-batch's skip tensor weighs, in the cost model's memory units
// (those of StageCost::activation); its gradient weighs the same. Routes need to_stage >= from_stage + 2:
// a skip between neighbours travels with the boundary bundle. See skip.h for the rules that use them.
struct SkipEdge {
  int from_stage = 0;
  int to_stage = 0;
  double size = 0.0;
  friend bool operator==(const SkipEdge& a, const SkipEdge& b) {
    return a.from_stage == b.from_stage && a.to_stage == b.to_stage && a.size == b.size;
  }
};

struct Schedule {
  std::string name = "custom";   // generator name, or "custom" for hand-written schedules
  int ranks = 1;                 // p: number of ranks (devices / processes)
  int stages = 1;                // S: number of (virtual) stages; S = p * v for interleaved
  int microbatches = 1;          // total micro-batches over all steps
  int microbatches_per_step = 1; // micro-batches accumulated into one optimizer step
  bool synchronous = true;       // true: forwards of step k+1 wait for step k's optimizer step (flush)
  std::vector<int> stage_rank;   // stage_rank[s]: the rank that owns stage s (size = stages)
  // Stage replication (PipeDream's 1F1B-RR): empty, or per stage the ranks holding a replica of it, in
  // round-robin order: micro-batch i of stage s runs on stage_replicas[s][i % stage_replicas[s].size()].
  // stage_rank[s] is then stage_replicas[s][0]. Every replica runs the stage's optimizer steps.
  std::vector<std::vector<int>> stage_replicas;
  std::vector<std::vector<Action>> actions;  // actions[r]: rank r's actions in order (size = ranks)
  // The model's skip routes (empty: none). Lowering adds their transfers; the validator and the
  // simulator wait for them; the simulator charges their time and memory.
  std::vector<SkipEdge> skips;

  int steps() const { return (microbatches + microbatches_per_step - 1) / microbatches_per_step; }
  int virtual_stages_per_rank() const { return replicated() || ranks > stages ? 1 : stages / ranks; }
  int rank_of(int stage) const { return stage_rank.at(static_cast<std::size_t>(stage)); }
  // The rank that runs micro-batch `micro` of `stage` (its replica under round robin).
  int rank_of(int stage, int micro) const {
    if (stage_replicas.empty()) return rank_of(stage);
    const auto& r = stage_replicas.at(static_cast<std::size_t>(stage));
    return r[static_cast<std::size_t>(micro) % r.size()];
  }
  int replicas_of(int stage) const {
    return stage_replicas.empty() ? 1 : static_cast<int>(stage_replicas.at(static_cast<std::size_t>(stage)).size());
  }
  bool replicated() const { return !stage_replicas.empty(); }
  // Whether `rank` holds stage `stage` (one of its replicas).
  bool holds(int rank, int stage) const;
  // The lowest stage `rank` holds, or -1 when it holds none.
  int first_stage_of(int rank) const;
  // The step that micro-batch i belongs to.
  int step_of(int micro) const { return micro / microbatches_per_step; }

  friend bool operator==(const Schedule& a, const Schedule& b);
};

// Rank r's actions as one line of text, one cell (an action or a pair `(a;b)`) per word.
std::string rank_line(const Schedule& s, int rank);

// CSV form, one row per rank (row r is rank r), one action per cell, e.g.
//   # pipetrain schedule name=1f1b ranks=2 stages=2 microbatches=2 microbatches_per_step=2 synchronous=1
//   0F0,0F1,0BW0,0BW1,0S0
//   1F0,1BW0,1F1,1BW1,1S0
// The header comment is optional when loading: without it the sizes are inferred from the actions
// (stages and micro-batches from the largest indices, the stage-to-rank map from where each stage
// appears, one step over all micro-batches, synchronous). Blank lines and other lines starting with
// '#' are ignored. A paired slot (action.h) is one cell, (0F7;7BW3); where a lowered schedule runs
// transfers between its two halves, the halves are cells of their own around them: (0F7;,0SF7,7BW3).
// Skip routes travel in the header as skips=FROM:TO:SIZE,FROM:TO:SIZE. Throws UsageError naming the line and cell on malformed input.
std::string to_csv(const Schedule& s);
Schedule from_csv(const std::string& text);

// Loads a CSV schedule from a file; throws UsageError if it cannot be read.
Schedule load_csv_file(const std::string& path);

}  // namespace pipetrain

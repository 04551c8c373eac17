// Schedules are data: generate three of them for 4 ranks and 8 micro-batches, validate them and
// simulate them with a backward twice the forward (B = W = F), then print makespan and bubble. Needs no
// LibTorch (pipetrain::core).
#include <cstdio>

#include "pipetrain/core/generators.h"
#include "pipetrain/core/simulate.h"
#include "pipetrain/core/validate.h"

int main() {
  pipetrain::GeneratorOptions g;
  g.ranks = 4;
  g.microbatches = 8;
  const auto costs = pipetrain::CostModel::uniform(4, pipetrain::StageCost{1.0, 1.0, 1.0, 1.0});
  double gpipe_makespan = 0;
  for (const char* name : {"gpipe", "1f1b", "zb-h1"}) {
    const pipetrain::Schedule s = pipetrain::generate(name, g);
    pipetrain::validate(s);
    const pipetrain::Metrics m = pipetrain::simulate(s, costs).metrics;
    if (gpipe_makespan == 0) gpipe_makespan = m.makespan;
    std::printf("%-6s makespan %5.1f  bubble %.3f  peak memory %.0f micro-batches\n", name, m.makespan,
                m.bubble_fraction, m.per_rank.front().peak_memory);
  }
  return gpipe_makespan > 0 ? 0 : 1;
}

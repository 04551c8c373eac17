#include "pipetrain/core/simulate_json.h"

#include <string>

#include "pipetrain/core/action.h"

namespace pipetrain {

nlohmann::json simulation_json(const Schedule& s, const SimResult& r, const std::vector<HeapPeak>& heap,
                               const HeapOptions& policy) {
  nlohmann::json j;
  j["schedule"] = s.name;
  j["stages"] = s.ranks;
  j["virtual_stages"] = s.virtual_stages_per_rank();
  j["microbatches"] = s.microbatches_per_step;
  j["steps"] = s.steps();
  j["makespan"] = r.metrics.makespan;
  j["bubble_fraction"] = r.metrics.bubble_fraction;
  j["max_bubble"] = r.metrics.max_bubble();
  j["per_stage"] = nlohmann::json::array();
  for (const RankMetrics& m : r.metrics.per_rank) {
    const HeapPeak& h = heap.at(static_cast<std::size_t>(m.rank));
    j["per_stage"].push_back({{"stage", m.rank},
                              {"busy", m.busy},
                              {"span", m.span},
                              {"bubble", m.bubble},
                              {"peak_inflight", m.peak_inflight},
                              {"peak_memory", m.peak_memory},
                              {"heap", {{"total", h.total()},
                                        {"activations", h.activations},
                                        {"gradients", h.gradients},
                                        {"transfers", h.transfers},
                                        {"after", h.position < 0 ? std::string() : to_string(h.after)}}}});
  }
  j["heap_policy"] = {{"receives_ahead", policy.receives_ahead}, {"sends_in_flight", policy.sends_in_flight}};
  if (!s.skips.empty()) {
    j["skips"] = nlohmann::json::array();
    for (const SkipEdge& k : s.skips)
      j["skips"].push_back({{"from_stage", k.from_stage}, {"to_stage", k.to_stage}, {"size", k.size}});
  }
  return j;
}

}  // namespace pipetrain

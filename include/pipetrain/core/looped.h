// A looped schedule (interleaved, interleaved-zb, looped-bfs: ScheduleTraits::virtual_stages) asked for with
// one stage per rank is the unlooped one under its name (interleaved gives 1F1B's order, looped-bfs GPipe's).
// The command line, the library and the Python module refuse it alike, through this one check.
#pragma once

#include <string>

namespace pipetrain {

// Throws UsageError when `schedule` loops and `virtual_stages` is 1, naming `virtual_name` (the caller's
// spelling of the count: "--virtual", "virtual_stages", "virtual") with `note` after the 1.
void refuse_looped_without_loops(const std::string& schedule, int virtual_stages, const std::string& virtual_name,
                                 const std::string& note = "");

}  // namespace pipetrain

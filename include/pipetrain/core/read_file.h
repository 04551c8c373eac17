// Reading input files with a size cap. Every parser of a user's file (schedule CSV and text, profile
// JSON, PipeDream graphs, plan files, config files) reads through here, so `/dev/zero`, a FIFO or a
// folder is refused up front instead of read until memory runs out or parsed as "no rows". Torch-free.
#pragma once

#include <cstdint>
#include <string>

namespace pipetrain {

// Caps per kind of file, in bytes. Generous: a 100k-layer profile is about 30 MB of JSON.
inline constexpr std::uint64_t kMaxScheduleFileBytes = 64ull << 20;
inline constexpr std::uint64_t kMaxProfileFileBytes = 256ull << 20;
inline constexpr std::uint64_t kMaxPlanFileBytes = 64ull << 20;
inline constexpr std::uint64_t kMaxConfigFileBytes = 1ull << 20;

// Reads `path` whole. `what` names the file's role in messages ("schedule file", "profile", ...).
// Throws UsageError (exit 2) naming the path and the fix when the path does not exist or cannot be read,
// is a folder ("is a folder"), is not a regular file (a device, FIFO or socket: "is not a regular
// file"), or is larger than `max_bytes` (naming its size and the cap). The size is checked before
// reading, and the read itself stops at the cap, so a file that grows while being read is refused too.
std::string read_file_capped(const std::string& path, const std::string& what, std::uint64_t max_bytes);

}  // namespace pipetrain

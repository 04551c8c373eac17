// Error types shared by every layer.
//
// UsageError: the caller gave a bad value (a flag, a file, a schedule). The message names the value and
// says what would be valid; the command-line tool maps it to exit code 2.
// NonFiniteError: training produced a NaN or infinite loss or gradient norm (diverged); a runtime failure.
// Any other std::exception is a runtime failure (exit code 1).
#pragma once

#include <stdexcept>
#include <string>

namespace pipetrain {

class UsageError : public std::invalid_argument {
 public:
  explicit UsageError(const std::string& what) : std::invalid_argument(what) {}
};

// A schedule that is incomplete, out of order, deadlocks or exceeds its memory limit. The message
// carries the step x rank grid with the offending cell marked.
class ScheduleError : public UsageError {
 public:
  explicit ScheduleError(const std::string& what) : UsageError(what) {}
};

// A step whose loss or gradient norm is NaN or infinite, found before its optimizer step (synchronous
// schedules: on every rank at once, the weights untouched). The message names the step, the values,
// the stages whose gradients were not finite, and the fix.
class NonFiniteError : public std::runtime_error {
 public:
  explicit NonFiniteError(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace pipetrain

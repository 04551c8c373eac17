// Timelines: when each action ran on each rank, predicted by the simulator or measured by the runtime,
// and the metrics and pictures made from them. Both sources produce the same Timeline type, so the
// same writers draw them and predicted and measured runs can be compared side by side.
//
// Conventions (docs/ALGORITHMS.md §1.7):
//   busy_r   = sum of the durations of rank r's compute actions (F, B, W, BW)
//   span_r   = last finish - first start on rank r
//   bubble_r = span_r - busy_r                       (per-rank, zero-bubble convention)
//   bubble_fraction = 1 - sum_r busy_r / (p * makespan)
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

#include "pipetrain/core/action.h"
#include "pipetrain/core/cost.h"

namespace pipetrain {

struct TimedAction {
  int rank = 0;
  Action action;
  double start = 0.0;
  double end = 0.0;
};

struct Timeline {
  std::string schedule;     // schedule name, for titles
  int ranks = 0;            // p
  int microbatches = 0;     // m per step, for titles
  int total_microbatches = 0;  // all micro-batches of the run (0: microbatches); titles show both when they differ
  int virtual_stages = 1;   // v
  std::string unit = "ms";  // time unit of start/end ("ms", "s", "units")
  std::vector<TimedAction> events;  // any order
};

struct RankMetrics {
  int rank = 0;
  double busy = 0.0;
  double span = 0.0;
  double bubble = 0.0;
  int peak_inflight = 0;      // micro-batches (per virtual stage) with F done and backward not done
  double peak_memory = 0.0;   // peak activation memory, in the cost model's units
};

struct Metrics {
  double makespan = 0.0;
  double bubble_fraction = 0.0;
  std::vector<RankMetrics> per_rank;
  double max_bubble() const;  // max_r bubble_r (the zero-bubble papers' number)
};

// Busy, span, bubble and makespan from the events alone. Peak in-flight counts come from the order of
// F and backward events; peak_memory is left 0 (the simulator fills it from its cost model).
Metrics compute_metrics(const Timeline& t);

// Where the streamed writers below put their text: a file (AtomicFile), a string (StringSink), a stream.
class TextSink {
 public:
  virtual ~TextSink() = default;
  virtual void write(std::string_view bytes) = 0;
};

class StringSink : public TextSink {
 public:
  void write(std::string_view bytes) override { text.append(bytes); }
  std::string text;
};

class OstreamSink : public TextSink {
 public:
  explicit OstreamSink(std::ostream& out) : out_(out) {}
  void write(std::string_view bytes) override;

 private:
  std::ostream& out_;
};

// A timeline's events as the writers read them, without requiring them held as TimedActions: a measured
// Timeline (TimelineView) or the simulator's compact form (simulate.h's SimTimeline), which keeps a start
// time and an order per action instead of a 48-byte TimedAction. Events must pass the checks of
// compute_metrics (ranks in range, finite times, end >= start); TimelineView checks them.
class TimelineEvents {
 public:
  virtual ~TimelineEvents() = default;
  using Visit = std::function<void(const TimedAction&)>;
  // The titles' fields (schedule, ranks, microbatches, total_microbatches, virtual_stages, unit); its
  // `events` are not read.
  virtual const Timeline& header() const = 0;
  // Every event, rank 0's first, each rank's in start order (ties by end, then the order they were made).
  virtual void by_rank(const Visit& visit) const = 0;
  // Every event in start order across ranks (ties by end, then the order they were made).
  virtual void by_start(const Visit& visit) const = 0;
  // Every event, each rank's in the order they were made (ranks may interleave).
  virtual void in_order(const Visit& visit) const = 0;
};

// A Timeline's events (checked as compute_metrics checks them; UsageError naming the bad event). The
// orders are index arrays built on demand, 8 bytes per event.
class TimelineView : public TimelineEvents {
 public:
  explicit TimelineView(const Timeline& t);
  const Timeline& header() const override { return t_; }
  void by_rank(const Visit& visit) const override;
  void by_start(const Visit& visit) const override;
  void in_order(const Visit& visit) const override;

 private:
  const Timeline& t_;
};

// The streamed writers: what chrome_trace_json, gantt_svg and ascii_gantt return, written to `out` in
// pieces of at most 64 KiB as the events are visited, so the whole text is never held.
void write_chrome_trace(const TimelineEvents& t, TextSink& out);
void write_gantt_svg(const TimelineEvents& t, const Metrics& m, TextSink& out);
// chars_per_unit must be finite and > 0 (UsageError otherwise); a row wider than kMaxAsciiColumns is
// drawn at the scale that makes it that wide, said in a first line.
void write_ascii_gantt(const TimelineEvents& t, TextSink& out, double chars_per_unit = 2.0);
constexpr double kMaxAsciiColumns = 100000;
// The scale that gives the shortest compute action 2 characters (2 for unit costs; costs in ms, us or
// ns scale alike), as `simulate --ascii` draws.
double ascii_chars_per_unit(const TimelineEvents& t);

// Chrome trace JSON ("traceEvents"; opens in Perfetto and chrome://tracing): one track per rank, one
// complete ("X") slice per action, named in the action's text form, with the kind as category.
// Times are converted to microseconds from `t.unit` ("units" are drawn as milliseconds).
std::string chrome_trace_json(const Timeline& t);

// SVG Gantt chart: one row per rank, one colour per action kind with a legend, the micro-batch number
// on each box, idle time left empty, a time axis, and a title with schedule, p, m, v and the bubble
// fraction.
std::string gantt_svg(const Timeline& t, const Metrics& m);

// Writes `contents` to `path` atomically (temporary file, then rename), so a failure never leaves a
// half-written file. An existing `path` that is not a regular file (/dev/stdout, /dev/full, a FIFO) is
// written in place instead, every write and the close checked (renaming over it would replace the
// device node). Throws UsageError for a folder, std::runtime_error naming the path and the system's
// reason ("No space left on device") for any failed step.
void write_file_atomic(const std::string& path, const std::string& contents);

// write_file_atomic for text made in pieces: `produce` writes to the sink, which passes every piece
// straight to the temporary file beside `path` (or to the device written in place); the temporary file
// is renamed over `path` once `produce` returns, and removed if it or a write throws, so a failure never
// leaves a half-written file. Same errors as write_file_atomic; what `produce` throws is rethrown.
void write_file_atomic(const std::string& path, const std::function<void(TextSink&)>& produce);

// Checks, before any work starts, that an output flag's `path` can be written: refuses (UsageError
// naming `flag`, the path and the fix) a folder, a path ending in '/', a path whose folder does not exist,
// is not a folder or where no file can be created (it creates and removes the file to know), and an
// existing file that is not writable. An empty path (flag not given) passes. Devices and FIFOs pass
// (write_file_atomic writes them in place).
void check_output_path(const std::string& path, const std::string& flag);

}  // namespace pipetrain

namespace pipetrain {

// A plain-text Gantt chart, one line per rank, `chars_per_unit` characters per time unit. Each action
// is a box starting with its kind ('f' forward, 'b' input-gradient backward, 'w' weight gradient,
// 'B' fused backward, 'S' step) and micro-batch number, padded with '-'; idle time is '.'. Used for
// terminal output and for the pictures in the generators' header comments.
std::string ascii_gantt(const Timeline& t, double chars_per_unit = 2.0);

// A cost model from a measured timeline: per stage the mean time of its forwards, and of its fused
// backwards (b, w = 0) or else its input- and weight-gradient backwards; transfers and steps cost 0.
// The simulator given it predicts what the run would take with free communication and no overhead.
CostModel measured_costs(const Timeline& t, int stages);

// The runtime's terms besides compute, measured from the same timeline (which must hold the runtime's
// receive events, as the executor records them: a receive's wait before the action that needs it):
//  - transfer: per receive that was already waiting when its data was made on another rank (it started
//    before the producing F, B or BW ended), the time from that producer's end to the receive's end: the
//    send, the move and the wake-up, and no waiting for the peer's compute. The median of those; when no
//    receive waited, the smallest such gap of any receive (0 without receives). A skip receive
//    (`2RF0@0`) counts like a boundary one, its producer being its peer stage's F (or B/BW for a gradient):
//    with an unlimited skip bandwidth the simulator charges it `comm` too.
//  - overhead: per compute action, the ranks' time inside their spans that is neither compute, nor a
//    receive, nor a Step: the executor's work between actions and posting sends, summed over ranks and
//    divided by the compute actions.
//  - step: the shortest Step on any rank (the others include waiting for it in the step's all-reduce).
// Times come from the ranks' clocks as recorded, so ranks on different hosts need synchronised clocks
// for the transfer term.
struct MeasuredRuntime {
  double transfer = 0;
  int transfer_samples = 0;  // receives that were waiting (the median's sample count)
  double overhead = 0;
  double step = 0;
};
MeasuredRuntime measured_runtime(const Timeline& t);

// measured_costs with the measured runtime terms: comm = transfer, overhead and step as measured.
CostModel measured_costs_with_runtime(const Timeline& t, int stages);

}  // namespace pipetrain

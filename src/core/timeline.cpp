// Timeline metrics and writers (Chrome trace JSON, SVG Gantt chart, atomic file write).
// See pipetrain/core/timeline.h for the contracts and docs/ALGORITHMS.md §1.7 for the bubble conventions.
#include "pipetrain/core/timeline.h"

#include <fmt/format.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <utility>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"

namespace pipetrain {
namespace {

// Every writer and the metrics index per-rank arrays by `rank` and draw [start, end]: reject what would
// index out of range or draw nonsense, naming the event and the fix.
void check_events(const Timeline& t) {
  if (t.ranks < 0) throw UsageError(fmt::format("timeline has {} ranks: the rank count must be >= 0", t.ranks));
  for (const TimedAction& e : t.events) {
    if (e.rank < 0 || e.rank >= t.ranks)
      throw UsageError(fmt::format("timeline event {} is on rank {} but the timeline has {} ranks: use ranks 0..{}",
                                   to_string(e.action), e.rank, t.ranks, t.ranks - 1));
    if (!std::isfinite(e.start) || !std::isfinite(e.end) || e.end < e.start)
      throw UsageError(fmt::format("timeline event {} on rank {} has start {} and end {}: times must be finite "
                                   "with end >= start",
                                   to_string(e.action), e.rank, e.start, e.end));
  }
}

// Microseconds per one unit of `unit` (Chrome trace times are in microseconds).
double micros_per_unit(const std::string& unit) {
  if (unit == "ms" || unit == "units") return 1e3;  // "units" (abstract cost-model time) drawn as ms
  if (unit == "s") return 1e6;
  if (unit == "us") return 1.0;
  throw UsageError(fmt::format("timeline unit '{}' is not known: use one of ms, s, us, units", unit));
}

// Indices of `events` sorted by start, ties by end, then by input position (stable).
std::vector<std::size_t> start_order(const std::vector<TimedAction>& events) {
  std::vector<std::size_t> idx(events.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) {
    if (events[a].start != events[b].start) return events[a].start < events[b].start;
    return events[a].end < events[b].end;
  });
  return idx;
}

std::string xml_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

struct KindStyle {
  const char* fill;
  const char* text;    // colour of the micro-batch number on the box
  const char* legend;  // legend label
};

KindStyle style_of(ActionKind k) {
  switch (k) {
    case ActionKind::F: return {"#6fa8dc", "#10243a", "F forward"};
    case ActionKind::B: return {"#f6a04d", "#3a2208", "B input grad"};
    case ActionKind::W: return {"#8cc084", "#13300f", "W weight grad"};
    case ActionKind::BW: return {"#c58fd1", "#2e0f36", "BW backward (B+W)"};
    case ActionKind::SendAct: return {"#8a8a8a", "#000000", "SF send activation"};
    case ActionKind::RecvAct: return {"#b0b0b0", "#000000", "RF recv activation"};
    case ActionKind::SendGrad: return {"#6e6e6e", "#000000", "SB send gradient"};
    case ActionKind::RecvGrad: return {"#c4c4c4", "#000000", "RB recv gradient"};
    case ActionKind::Step: return {"#333333", "#ffffff", "S optimizer step"};
  }
  return {"#000000", "#ffffff", "?"};
}

// A "round" tick step (1, 2 or 5 times a power of ten) giving about 6 intervals over `range`.
double tick_step(double range) {
  const double raw = range / 6.0;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  const double mult = norm < 1.5 ? 1.0 : norm < 3.5 ? 2.0 : norm < 7.5 ? 5.0 : 10.0;
  return mult * mag;
}

}  // namespace

double Metrics::max_bubble() const {
  double best = 0.0;
  for (const RankMetrics& r : per_rank) best = std::max(best, r.bubble);
  return best;
}

Metrics compute_metrics(const Timeline& t) {
  check_events(t);
  Metrics m;
  m.per_rank.resize(static_cast<std::size_t>(t.ranks));
  for (int r = 0; r < t.ranks; ++r) m.per_rank[static_cast<std::size_t>(r)].rank = r;
  if (t.events.empty()) return m;

  double t0 = std::numeric_limits<double>::infinity();
  double t1 = -std::numeric_limits<double>::infinity();
  std::vector<double> first(m.per_rank.size(), std::numeric_limits<double>::infinity());
  std::vector<double> last(m.per_rank.size(), -std::numeric_limits<double>::infinity());
  for (const TimedAction& e : t.events) {
    t0 = std::min(t0, e.start);
    t1 = std::max(t1, e.end);
    if (!is_compute(e.action.kind)) continue;
    const auto r = static_cast<std::size_t>(e.rank);
    m.per_rank[r].busy += e.end - e.start;
    first[r] = std::min(first[r], e.start);
    last[r] = std::max(last[r], e.end);
  }
  m.makespan = t1 - t0;
  double busy = 0.0;
  for (std::size_t r = 0; r < m.per_rank.size(); ++r) {
    RankMetrics& rm = m.per_rank[r];
    if (last[r] >= first[r]) rm.span = last[r] - first[r];
    rm.bubble = rm.span - rm.busy;
    busy += rm.busy;
  }
  if (m.makespan > 0.0 && t.ranks > 0) m.bubble_fraction = 1.0 - busy / (t.ranks * m.makespan);

  // In flight: a (stage, micro) pair enters on F and leaves on its last backward — BW, or W for split
  // schedules. A pair whose B never gets a W on this rank leaves on B.
  //
  //   rank 0:  F0 F1 B0 F2 W0 B1 W1 ...     in flight: 1 2 2 3 2 2 1   (B0 keeps 0 in flight until W0)
  using Pair = std::pair<int, int>;
  std::vector<std::set<Pair>> has_w(m.per_rank.size());
  for (const TimedAction& e : t.events)
    if (e.action.kind == ActionKind::W) has_w[static_cast<std::size_t>(e.rank)].insert({e.action.stage, e.action.index});
  std::vector<std::set<Pair>> live(m.per_rank.size());
  for (std::size_t i : start_order(t.events)) {
    const TimedAction& e = t.events[i];
    const auto r = static_cast<std::size_t>(e.rank);
    const Pair key{e.action.stage, e.action.index};
    switch (e.action.kind) {
      case ActionKind::F:
        live[r].insert(key);
        m.per_rank[r].peak_inflight = std::max(m.per_rank[r].peak_inflight, static_cast<int>(live[r].size()));
        break;
      case ActionKind::BW:
      case ActionKind::W: live[r].erase(key); break;
      case ActionKind::B:
        if (has_w[r].count(key) == 0) live[r].erase(key);
        break;
      default: break;
    }
  }
  return m;
}

void OstreamSink::write(std::string_view bytes) { out_.write(bytes.data(), static_cast<std::streamsize>(bytes.size())); }

TimelineView::TimelineView(const Timeline& t) : t_(t) { check_events(t); }

void TimelineView::by_rank(const Visit& visit) const {
  std::vector<std::size_t> order = start_order(t_.events);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return t_.events[a].rank < t_.events[b].rank; });
  for (std::size_t i : order) visit(t_.events[i]);
}

void TimelineView::by_start(const Visit& visit) const {
  for (std::size_t i : start_order(t_.events)) visit(t_.events[i]);
}

void TimelineView::in_order(const Visit& visit) const {
  for (const TimedAction& e : t_.events) visit(e);
}

namespace {

// The writers' fixed buffer: text is formatted into it and handed to the sink in pieces of ~64 KiB.
class Chunked {
 public:
  explicit Chunked(TextSink& sink) : sink_(sink) {}
  template <class... Args>
  void put(fmt::format_string<Args...> f, Args&&... args) {
    fmt::format_to(std::back_inserter(buf_), f, std::forward<Args>(args)...);
    if (buf_.size() >= kChunk) flush();
  }
  void raw(std::string_view text) {
    buf_.append(text.data(), text.data() + text.size());
    if (buf_.size() >= kChunk) flush();
  }
  // A double as nlohmann::json's dump() writes it (shortest round-trip form, "null" if not finite).
  void json_number(double x) {
    if (!std::isfinite(x)) return raw("null");
    char digits[64];
    const char* end = nlohmann::detail::to_chars(digits, digits + sizeof digits, x);
    raw(std::string_view(digits, static_cast<std::size_t>(end - digits)));
  }
  void flush() {
    if (buf_.size() == 0) return;
    sink_.write(std::string_view(buf_.data(), buf_.size()));
    buf_.clear();
  }

 private:
  static constexpr std::size_t kChunk = 64 * 1024;
  TextSink& sink_;
  fmt::memory_buffer buf_;
};

}  // namespace

// The text nlohmann::json's dump() made from the trace's document (keys sorted, no spaces), written as
// the events are visited: tests/core/test_timeline.cpp compares the two.
void write_chrome_trace(const TimelineEvents& events, TextSink& sink) {
  const Timeline& t = events.header();
  const double scale = micros_per_unit(t.unit);
  using nlohmann::json;
  Chunked out(sink);
  out.put("{{\"displayTimeUnit\":\"ms\",\"otherData\":{{\"microbatches\":{},\"ranks\":{},\"schedule\":{},"
          "\"unit\":{},\"virtual_stages\":{}}},\"traceEvents\":[",
          t.microbatches, t.ranks, json(t.schedule).dump(), json(t.unit).dump(), t.virtual_stages);
  out.put("{{\"args\":{{\"name\":{}}},\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0}}",
          json("pipetrain: " + t.schedule).dump());
  for (int r = 0; r < t.ranks; ++r) {
    out.put(",{{\"args\":{{\"name\":\"rank {}\"}},\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":{}}}", r, r);
    out.put(",{{\"args\":{{\"sort_index\":{}}},\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":0,\"tid\":{}}}",
            r, r);
  }
  // Deterministic output: by rank, then in start order. Kind names and action texts need no escaping.
  events.by_rank([&](const TimedAction& e) {
    const std::string_view kind = kind_name(e.action.kind);
    if (e.action.kind == ActionKind::Step)
      out.put(",{{\"args\":{{\"kind\":\"{}\",\"stage\":{},\"step\":{}}}", kind, e.action.stage, e.action.index);
    else
      out.put(",{{\"args\":{{\"kind\":\"{}\",\"micro\":{},\"stage\":{}}}", kind, e.action.index, e.action.stage);
    out.put(",\"cat\":\"{}\",\"dur\":", kind);
    out.json_number((e.end - e.start) * scale);
    out.put(",\"name\":\"{}\",\"ph\":\"X\",\"pid\":0,\"tid\":{},\"ts\":", to_string(e.action), e.rank);
    out.json_number(e.start * scale);
    out.raw("}");
  });
  out.raw("]}\n");
  out.flush();
}

std::string chrome_trace_json(const Timeline& t) {
  StringSink out;
  write_chrome_trace(TimelineView(t), out);
  return std::move(out.text);
}

// Layout (pixels):
//
//   title line
//   rank 0 | [recv strip] [compute/step boxes] [send strip] |  bubble b0
//   rank 1 | ...                                             |  bubble b1
//          +----+----+----+----+  time axis, round ticks in t.unit
//   legend: one swatch per kind present
void write_gantt_svg(const TimelineEvents& events, const Metrics& m, TextSink& sink) {
  const Timeline& t = events.header();
  constexpr double kWidth = 1400, kLeft = 80, kRight = 110, kTop = 46;
  constexpr double kRowH = 30, kRowGap = 4;
  constexpr double kStrip = 4;                              // height of the thin comm boxes
  constexpr double kBoxY = kStrip + 2, kBoxH = kRowH - 2 * kBoxY;  // compute box inside the row
  const double plot_w = kWidth - kLeft - kRight;

  // One pass for the time range and the kinds present (the legend).
  double t0 = std::numeric_limits<double>::infinity();
  double t1 = -std::numeric_limits<double>::infinity();
  bool any = false;
  std::set<ActionKind> kinds;
  events.in_order([&](const TimedAction& e) {
    t0 = std::min(t0, e.start);
    t1 = std::max(t1, e.end);
    any = true;
    kinds.insert(e.action.kind);
  });
  if (!any) t0 = t1 = 0.0;
  const double range = t1 > t0 ? t1 - t0 : 1.0;
  auto x_of = [&](double time) { return kLeft + (time - t0) / range * plot_w; };

  const double rows_bottom = kTop + t.ranks * (kRowH + kRowGap);
  const double axis_y = rows_bottom + 2;
  const double legend_y = axis_y + 50;


  // Legend entries laid out left to right, wrapping at the plot width.
  struct Entry { ActionKind kind; double x, y; };
  std::vector<Entry> legend;
  {
    double x = kLeft, y = legend_y;
    for (ActionKind k : kinds) {
      const double w = 26 + 7.0 * static_cast<double>(std::strlen(style_of(k).legend)) + 22;
      if (x + w > kWidth - 10 && x > kLeft) { x = kLeft; y += 22; }
      legend.push_back({k, x, y});
      x += w;
    }
  }
  const double height = (legend.empty() ? legend_y : legend.back().y) + 24;

  Chunked out(sink);
  out.put(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0:.0f}\" height=\"{1:.0f}\" viewBox=\"0 0 {0:.0f} {1:.0f}\" "
      "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n",
      kWidth, height);
  out.put("<rect class=\"background\" x=\"0\" y=\"0\" width=\"{:.0f}\" height=\"{:.0f}\" fill=\"#ffffff\"/>\n",
                     kWidth, height);
  out.put(
      "<text class=\"title\" x=\"{:.0f}\" y=\"26\" font-size=\"16\" font-weight=\"bold\" xml:space=\"preserve\">"
      "{}  p={}  m={}  v={}  bubble fraction={:.3f}  makespan={:g} {}</text>\n",
      kLeft, xml_escape(t.schedule), t.ranks,
      // PipeDream steps after every micro-batch: "m=1" alone read as one micro-batch in a chart of eight.
      t.total_microbatches > t.microbatches && t.microbatches > 0
          ? fmt::format("{} per step ({} micro-batches, {} steps)", t.microbatches, t.total_microbatches,
                        t.total_microbatches / t.microbatches)
          : std::to_string(t.microbatches),
      t.virtual_stages, m.bubble_fraction, m.makespan, xml_escape(t.unit));

  // Rows: light background, label on the left, per-rank bubble on the right.
  for (int r = 0; r < t.ranks; ++r) {
    const double y = kTop + r * (kRowH + kRowGap);
    out.put("<rect class=\"row\" x=\"{:.0f}\" y=\"{:.1f}\" width=\"{:.0f}\" height=\"{:.0f}\" fill=\"#f3f4f6\"/>\n",
                       kLeft, y, plot_w, kRowH);
    out.put("<text x=\"{:.0f}\" y=\"{:.1f}\" font-size=\"13\" text-anchor=\"end\">rank {}</text>\n", kLeft - 8,
                       y + kRowH / 2 + 4.5, r);
    if (static_cast<std::size_t>(r) < m.per_rank.size())
      out.put("<text x=\"{:.0f}\" y=\"{:.1f}\" font-size=\"11\" fill=\"#555555\">bubble {:.4g}</text>\n",
                         kLeft + plot_w + 8, y + kRowH / 2 + 4, m.per_rank[static_cast<std::size_t>(r)].bubble);
  }

  // Time axis with round ticks and light grid lines behind the boxes.
  const double step = tick_step(range);
  const int decimals = step >= 1.0 ? 0 : static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
  out.put("<line x1=\"{0:.0f}\" y1=\"{1:.1f}\" x2=\"{2:.0f}\" y2=\"{1:.1f}\" stroke=\"#333333\" stroke-width=\"1\"/>\n",
                     kLeft, axis_y, kLeft + plot_w);
  for (double n = std::ceil(t0 / step - 1e-9);; n += 1.0) {
    double tick = n * step;
    if (tick > t0 + range + 1e-9 * range) break;
    if (std::fabs(tick) < 1e-9 * step) tick = 0.0;  // no "-0"
    const double x = x_of(tick);
    if (t.ranks > 0)
      out.put("<line x1=\"{0:.2f}\" y1=\"{1:.0f}\" x2=\"{0:.2f}\" y2=\"{2:.1f}\" stroke=\"#dddddd\" stroke-width=\"1\"/>\n",
                         x, kTop, rows_bottom);
    out.put("<line x1=\"{0:.2f}\" y1=\"{1:.1f}\" x2=\"{0:.2f}\" y2=\"{2:.1f}\" stroke=\"#333333\" stroke-width=\"1\"/>\n",
                       x, axis_y, axis_y + 5);
    out.put("<text x=\"{:.2f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"middle\">{:.{}f}</text>\n", x,
                       axis_y + 18, tick, decimals);
  }
  out.put("<text x=\"{:.0f}\" y=\"{:.1f}\" font-size=\"12\" text-anchor=\"middle\">time ({})</text>\n",
                     kLeft + plot_w / 2, axis_y + 34, xml_escape(t.unit));

  // Boxes: compute and Step fill the middle of the row; receives are a thin strip at its top, sends at
  // its bottom, so communication that overlaps compute stays visible.
  events.by_start([&](const TimedAction& e) {
    const KindStyle st = style_of(e.action.kind);
    const double row_y = kTop + e.rank * (kRowH + kRowGap);
    double y = row_y + kBoxY, h = kBoxH;
    if (e.action.kind == ActionKind::RecvAct || e.action.kind == ActionKind::RecvGrad) {
      y = row_y + 1;
      h = kStrip;
    } else if (is_comm(e.action.kind)) {
      y = row_y + kRowH - 1 - kStrip;
      h = kStrip;
    }
    const double x = x_of(e.start);
    const double w = std::max(1.0, x_of(e.end) - x);
    const std::string text = to_string(e.action);
    out.put(
        "<rect class=\"box\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{:.1f}\" fill=\"{}\" stroke=\"#ffffff\" "
        "stroke-width=\"0.5\"><title>{} rank {} [{:g}, {:g}] {}</title></rect>\n",
        x, y, w, h, st.fill, xml_escape(text), e.rank, e.start, e.end, xml_escape(t.unit));
    if (is_comm(e.action.kind)) return;
    // Micro-batch number (step number for Step), as large as fits, omitted when the box is too narrow.
    const std::string label = std::to_string(e.action.index);
    const double fit = (w - 3) / (0.62 * static_cast<double>(label.size()));
    const double fs = std::floor(std::min(11.0, fit) * 2) / 2;
    if (fs < 6.0) return;
    out.put(
        "<text class=\"micro\" x=\"{:.2f}\" y=\"{:.2f}\" font-size=\"{:g}\" text-anchor=\"middle\" fill=\"{}\" "
        "pointer-events=\"none\">{}</text>\n",
        x + w / 2, y + h / 2 + fs * 0.35, fs, st.text, label);
  });

  for (const Entry& en : legend) {
    const KindStyle st = style_of(en.kind);
    out.put(
        "<rect class=\"legend\" x=\"{:.0f}\" y=\"{:.0f}\" width=\"18\" height=\"14\" fill=\"{}\"/>"
        "<text x=\"{:.0f}\" y=\"{:.0f}\" font-size=\"12\">{}</text>\n",
        en.x, en.y - 11, st.fill, en.x + 24, en.y, xml_escape(st.legend));
  }
  out.raw("</svg>\n");
  out.flush();
}

std::string gantt_svg(const Timeline& t, const Metrics& m) {
  StringSink out;
  write_gantt_svg(TimelineView(t), m, out);
  return std::move(out.text);
}


namespace {

std::string parent_folder(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

namespace {

// The file a chain of symbolic links at `path` ends at (existing or not: a dangling link's target is
// created); `path` itself when it is no link. Relative links are read from their own folder.
std::string link_target(const std::string& path) {
  std::string at = path;
  for (int hops = 0; hops < 40; ++hops) {  // as the kernel's limit, so a loop ends (open then fails: ELOOP)
    struct stat st {};
    if (::lstat(at.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return at;
    std::string to(static_cast<std::size_t>(PATH_MAX), '\0');
    const ssize_t n = ::readlink(at.c_str(), to.data(), to.size());
    if (n <= 0) return at;
    to.resize(static_cast<std::size_t>(n));
    const std::size_t slash = at.rfind('/');
    at = to.front() == '/' || slash == std::string::npos ? to : at.substr(0, slash + 1) + to;
  }
  return path;
}

}  // namespace

void check_output_path(const std::string& path, const std::string& flag) {
  if (path.empty()) return;
  const std::string shown = flag + " " + excerpt(path, 200);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode))
      throw UsageError(shown + " is a folder: give a file path, e.g. " + flag + " " +
                       (path.back() == '/' ? path : path + "/") + "out");
    if (::access(path.c_str(), W_OK) != 0)
      throw UsageError(fmt::format("{} cannot be written ({}): choose another path or fix its permissions", shown,
                                   std::strerror(errno)));
    // A device or FIFO is written in place. A regular file is replaced through a temporary file beside
    // it (write_file_atomic), so its folder must take a new file too (a writable file in a read-only
    // folder passed here, and the run failed at its end, its timeline lost).
    if (!S_ISREG(st.st_mode)) return;
  } else if (errno != ENOENT && errno != ENOTDIR) {
    throw UsageError(fmt::format("{} cannot be written ({}): choose another path", shown, std::strerror(errno)));
  }
  if (path.back() == '/')
    throw UsageError(shown + " names a folder that does not exist: give a file path, without the final '/'");
  const std::string parent = parent_folder(link_target(path));  // a dangling link's file is made where it points
  if (::stat(parent.c_str(), &st) != 0)
    throw UsageError(fmt::format("{}: the folder '{}' does not exist ({}): create it first (mkdir -p {}) or "
                                 "choose another path",
                                 shown, excerpt(parent, 200), std::strerror(errno), excerpt(parent, 200)));
  if (!S_ISDIR(st.st_mode))
    throw UsageError(fmt::format("{}: '{}' is not a folder: choose another path", shown, excerpt(parent, 200)));
  // Creating a file is the one sure test (root passes access(), yet /proc or a full quota refuse files);
  // the probe is removed at once, so a run that fails later leaves nothing behind. Its name is this
  // process's and this call's own: every rank of a run checks its flags at the same moment, and with the
  // target's own name a rank whose create came second failed with "File exists".
  static std::atomic<unsigned> probes{0};
  const std::string probe = parent + "/.pipetrain-probe-" + std::to_string(static_cast<long>(::getpid())) + "-" +
                            std::to_string(probes++);
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0)
    throw UsageError(fmt::format("{}: cannot create a file in the folder '{}' ({}): choose another folder or fix "
                                 "its permissions",
                                 shown, excerpt(parent, 200), std::strerror(errno)));
  ::close(fd);
  ::unlink(probe.c_str());
}

namespace {

// The file write_file_atomic fills: a temporary file beside the path, renamed over it by commit(), or
// (an existing device, FIFO or socket) the path itself, written in place. Destroyed uncommitted, it
// closes and removes the temporary file. Every write and the close are checked.
class AtomicFile : public TextSink {
 public:
  explicit AtomicFile(const std::string& path) : path_(path), target_(link_target(path)) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      throw UsageError("cannot write '" + path + "': it is a folder; give the path of a file (in that folder or "
                       "elsewhere)");
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
      // A device (/dev/stdout, /dev/full), FIFO or socket: written in place. Renaming a temporary file
      // over it would replace the device node with a regular file.
      fd_ = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NOCTTY);
      if (fd_ < 0) fail("cannot open it for writing", errno);
      return;
    }
    // A symbolic link stays one: the file it points to is replaced (a rename over the link itself put a
    // regular file in its place), with its temporary file beside that file.
    // Its name has a random part and it is made exclusively, never through a link: a name planted ahead
    // (a symbolic link in a shared folder, guessed from the pid alone) made the write overwrite the file
    // the link led to.
    std::random_device entropy;
    for (int attempt = 0;; ++attempt) {
      tmp_ = target_ + ".tmp." + std::to_string(static_cast<long>(::getpid())) + "." +
             fmt::format("{:08x}{:08x}", entropy(), entropy());
      fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
      if (fd_ >= 0) break;
      const int err = errno;
      const std::string tried = tmp_;
      tmp_.clear();  // not ours: never removed
      if (err != EEXIST || attempt == 16)
        fail("cannot create the temporary file '" + tried + "' beside it (is the folder writable?)", err);
    }
    // A file replaced keeps its permissions (a rename gave it the new file's: 0666 less the umask).
    if (::stat(target_.c_str(), &st) == 0 && S_ISREG(st.st_mode)) (void)::fchmod(fd_, st.st_mode & 07777);
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() override {
    if (fd_ >= 0) ::close(fd_);
    if (!tmp_.empty()) std::remove(tmp_.c_str());
  }

  void write(std::string_view bytes) override {
    for (std::size_t done = 0; done < bytes.size();) {
      const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) written_failed(n < 0 ? errno : EIO);
      done += static_cast<std::size_t>(n);
    }
  }

  void commit() {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0 && errno != EINTR) written_failed(errno);
    if (tmp_.empty()) return;
    if (std::rename(tmp_.c_str(), target_.c_str()) != 0) {
      const int err = errno;
      fail("renaming '" + tmp_ + "' over it failed", err);  // the destructor removes the temporary file
    }
    tmp_.clear();
  }

 private:
  [[noreturn]] void fail(const std::string& what, int err) const {
    throw std::runtime_error(fmt::format("cannot write '{}': {}: {}", path_, what, std::strerror(err)));
  }
  [[noreturn]] void written_failed(int err) const {
    fail(tmp_.empty() ? std::string("writing failed") : "writing the temporary file '" + tmp_ + "' failed", err);
  }

  std::string path_;
  std::string target_;  // path_, or the file its symbolic links end at
  std::string tmp_;     // empty: written in place, or renamed
  int fd_ = -1;
};

}  // namespace

void write_file_atomic(const std::string& path, const std::function<void(TextSink&)>& produce) {
  AtomicFile file(path);
  produce(file);
  file.commit();
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  write_file_atomic(path, [&](TextSink& out) { out.write(contents); });
}

}  // namespace pipetrain

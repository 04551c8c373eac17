#include "pipetrain/plan/profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <queue>
#include <set>
#include <sstream>
#include <tuple>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"
#include "pipetrain/core/read_file.h"
#include "pipetrain/core/timeline.h"

namespace pipetrain {
namespace {
using nlohmann::json;

// "layers[3] (\"conv2\")": the index is what a script writer can find, the name what a person can.
std::string layer_label(std::size_t index, const std::string& name) {
  return fmt::format("layers[{}] (\"{}\")", index, excerpt(name));
}

[[noreturn]] void fail(const std::string& origin, const std::string& where, const std::string& problem,
                       const std::string& fix) {
  throw UsageError(fmt::format("{}: {}: {}; {}", origin, where, problem, fix));
}

// The largest amount a profile field may hold, by unit: far past any real layer, yet small enough that
// sums over 100k layers, products with micro-batch counts and ratios stay finite and meaningful (a
// parameter_bytes of 2^63 printed "18595431358.65x data parallelism").
//   milliseconds: 1e9 (11.6 days for one layer's pass); bytes: 2^50 (1 PiB for one layer);
//   bytes per millisecond: 1e12 (1 PB/s).
double amount_cap(const std::string& unit) {
  if (unit == "milliseconds") return 1e9;
  if (unit == "bytes") return 1125899906842624.0;  // 2^50
  return 1e12;
}

void check_amount(const std::string& origin, const std::string& where, double v, const char* unit) {
  if (!std::isfinite(v)) fail(origin, where, fmt::format("is {}", v), fmt::format("give a finite number of {}", unit));
  if (v < 0) fail(origin, where, fmt::format("is {}", v), fmt::format("{} cannot be negative", unit));
  if (v > amount_cap(unit))
    fail(origin, where, fmt::format("is {}", v),
         fmt::format("the most a profile field takes is {} {}; check the number (the unit is {})", amount_cap(unit), unit, unit));
}

// --- strict JSON access ----------------------------------------------------------------------------
struct Reader {
  std::string origin;

  const json& field(const json& obj, const std::string& path, const std::string& key, const std::string& hint) const {
    auto it = obj.find(key);
    if (it == obj.end()) fail(origin, path, "the required field \"" + key + "\" is missing", "add it (" + hint + ")");
    return *it;
  }
  double number(const json& obj, const std::string& path, const std::string& key, const char* unit) const {
    const json& v = field(obj, path, key, std::string("a number of ") + unit);
    // JSON booleans are not numbers here, though nlohmann would convert them.
    if (!v.is_number())
      fail(origin, path + "." + key, "is " + std::string(v.type_name()) + " " + json_excerpt(v),
           std::string("write a number of ") + unit);
    const double d = v.get<double>();
    check_amount(origin, path + "." + key, d, unit);
    return d;
  }
  int positive_int(const json& obj, const std::string& path, const std::string& key) const {
    const json& v = field(obj, path, key, "an integer >= 1");
    if (!v.is_number_integer())
      fail(origin, path + "." + key, "is " + std::string(v.type_name()) + " " + json_excerpt(v), "write an integer >= 1");
    const long long n = v.get<long long>();
    if (n < 1 || n > 1000000000LL) fail(origin, path + "." + key, fmt::format("is {}", n), "write an integer >= 1");
    return static_cast<int>(n);
  }
  std::string text(const json& obj, const std::string& path, const std::string& key) const {
    const json& v = field(obj, path, key, "a string");
    if (!v.is_string())
      fail(origin, path + "." + key, "is " + std::string(v.type_name()) + " " + json_excerpt(v), "write a string in quotes");
    return v.get<std::string>();
  }
  void only_keys(const json& obj, const std::string& path, const std::vector<std::string>& allowed) const {
    for (auto it = obj.begin(); it != obj.end(); ++it)
      if (std::find(allowed.begin(), allowed.end(), it.key()) == allowed.end()) {
        std::string list;
        for (const std::string& a : allowed) list += (list.empty() ? "" : ", ") + a;
        fail(origin, path, "unknown field \"" + excerpt(it.key()) + "\"",
             "the fields here are: " + list + " (check the spelling; docs/PROFILE.md)");
      }
  }
  void object(const json& v, const std::string& path) const {
    if (!v.is_object()) fail(origin, path, "is " + std::string(v.type_name()), "write a JSON object {...}");
  }
};

// Bytes are written as integers when they are whole numbers that a double holds exactly, so profiles
// read naturally (1644167168, not 1644167168.0).
json amount(double v) {
  if (v >= 0 && v < 9007199254740992.0 && std::floor(v) == v) return json(static_cast<std::uint64_t>(v));
  return json(v);
}

std::string trim(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::vector<std::string> split_on(const std::string& s, const std::string& sep) {
  std::vector<std::string> out;
  std::size_t at = 0;
  for (;;) {
    const std::size_t next = s.find(sep, at);
    if (next == std::string::npos) {
      out.push_back(s.substr(at));
      return out;
    }
    out.push_back(s.substr(at, next - at));
    at = next + sep.size();
  }
}

std::string read_whole_file(const std::string& path) { return read_file_capped(path, "profile", kMaxProfileFileBytes); }
}  // namespace

void normalise_bw_split(Profile& profile) {
  for (LayerProfile& l : profile.layers)
    if (!l.bw_split) {
      l.input_grad_ms = l.backward_ms;
      l.weight_grad_ms = 0;
    }
}

void validate_profile(const Profile& p, const std::string& origin) {
  if (p.micro_batch_size < 1)
    fail(origin, "micro_batch_size", fmt::format("is {}", p.micro_batch_size),
         "give the samples per micro-batch the profile was measured at (>= 1)");
  if (p.threads < 1) fail(origin, "threads", fmt::format("is {}", p.threads), "give the thread count used (>= 1)");
  if (p.layers.empty()) fail(origin, "layers", "there are no layers", "a profile needs one entry per layer");
  for (std::size_t i = 0; i < p.layers.size(); ++i) {
    const LayerProfile& l = p.layers[i];
    const std::string at = layer_label(i, l.name);
    if (l.type.empty())
      fail(origin, at + ".type", "is empty",
           "give the module type name (e.g. \"Linear\"); balance type:REGEX reads it");
    check_amount(origin, at + ".forward_ms", l.forward_ms, "milliseconds");
    check_amount(origin, at + ".backward_ms", l.backward_ms, "milliseconds");
    if (l.bw_split) {
      check_amount(origin, at + ".input_grad_ms", l.input_grad_ms, "milliseconds");
      check_amount(origin, at + ".weight_grad_ms", l.weight_grad_ms, "milliseconds");
    }
    check_amount(origin, at + ".activation_bytes", l.activation_bytes, "bytes");
    check_amount(origin, at + ".saved_bytes", l.saved_bytes, "bytes");
    if (l.w_held_bytes >= 0) check_amount(origin, at + ".w_held_bytes", l.w_held_bytes, "bytes");
    check_amount(origin, at + ".parameter_bytes", l.parameter_bytes, "bytes");
    check_amount(origin, at + ".optimizer_bytes", l.optimizer_bytes, "bytes");
    check_amount(origin, at + ".optimizer_ms", l.optimizer_ms, "milliseconds");
    int previous = 0;
    for (std::size_t k = 0; k < l.by_micro_batch.size(); ++k) {
      const SizeMeasurement& s = l.by_micro_batch[k];
      const std::string sat = fmt::format("{}.by_micro_batch[{}]", at, k);
      if (s.micro_batch_size <= previous)
        fail(origin, sat + ".micro_batch_size", fmt::format("is {} after {}", s.micro_batch_size, previous),
             "list sizes >= 1 in strictly increasing order, each once");
      previous = s.micro_batch_size;
      check_amount(origin, sat + ".forward_ms", s.forward_ms, "milliseconds");
      check_amount(origin, sat + ".backward_ms", s.backward_ms, "milliseconds");
    }
  }
  if (p.runtime) {
    const RuntimeCosts& rc = *p.runtime;
    if (rc.transport.empty())
      fail(origin, "runtime.transport", "is empty", "name the transport that was measured (local, gloo, shm or mpi)");
    check_amount(origin, "runtime.latency_ms", rc.latency_ms, "milliseconds");
    check_amount(origin, "runtime.bandwidth_bytes_per_ms", rc.bandwidth_bytes_per_ms, "bytes per millisecond");
    check_amount(origin, "runtime.overhead_ms", rc.overhead_ms, "milliseconds");
    for (std::size_t k = 0; k < rc.transfers.size(); ++k) {
      check_amount(origin, fmt::format("runtime.transfers[{}].bytes", k), rc.transfers[k].bytes, "bytes");
      check_amount(origin, fmt::format("runtime.transfers[{}].one_way_ms", k), rc.transfers[k].one_way_ms,
                   "milliseconds");
    }
    if (rc.allreduce.empty() != (rc.allreduce_ranks == 0) || rc.allreduce_ranks < 0 || rc.allreduce_ranks == 1)
      fail(origin, "runtime.allreduce.ranks", fmt::format("is {} with {} samples", rc.allreduce_ranks, rc.allreduce.size()),
           "give the ranks (at least 2) that the samples were measured over, or neither");
    for (std::size_t k = 0; k < rc.allreduce.size(); ++k) {
      check_amount(origin, fmt::format("runtime.allreduce.samples[{}].bytes", k), rc.allreduce[k].bytes, "bytes");
      check_amount(origin, fmt::format("runtime.allreduce.samples[{}].ms", k), rc.allreduce[k].one_way_ms,
                   "milliseconds");
    }
  }
}

double RuntimeCosts::transfer_ms(double bytes) const {
  return latency_ms + (bandwidth_bytes_per_ms > 0 ? bytes / bandwidth_bytes_per_ms : 0.0);
}

RuntimeCosts fit_transfers(const std::vector<TransferSample>& samples) {
  if (samples.empty()) throw UsageError("fitting transfer costs needs at least one measured message size");
  // Weighted by 1 / time^2, i.e. relative errors: sizes span four orders of magnitude, and plain least
  // squares would fit the largest message and miss the small ones' latency by far.
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0, mean = 0;
  for (const TransferSample& t : samples) {
    if (!std::isfinite(t.bytes) || !std::isfinite(t.one_way_ms) || t.bytes < 0 || t.one_way_ms < 0)
      throw UsageError(fmt::format("transfer sample ({} bytes, {} ms) must be finite and >= 0", t.bytes, t.one_way_ms));
    const double w = 1.0 / std::max(t.one_way_ms * t.one_way_ms, 1e-12);
    sw += w;
    sx += w * t.bytes;
    sy += w * t.one_way_ms;
    sxx += w * t.bytes * t.bytes;
    sxy += w * t.bytes * t.one_way_ms;
    mean += t.one_way_ms / static_cast<double>(samples.size());
  }
  RuntimeCosts rc;
  rc.transfers = samples;
  const double den = sw * sxx - sx * sx;
  const double slope = den > 1e-9 * sw * sxx ? (sw * sxy - sx * sy) / den : 0.0;
  if (slope > 0) {
    rc.bandwidth_bytes_per_ms = 1.0 / slope;
    rc.latency_ms = std::max(0.0, (sy - slope * sx) / sw);
  } else {
    rc.latency_ms = mean;  // no measurable growth with size: the mean time is the latency
  }
  return rc;
}

json profile_to_json(const Profile& p) {
  json layers = json::array();
  for (const LayerProfile& l : p.layers) {
    json o = {{"name", l.name},
              {"type", l.type},
              {"forward_ms", l.forward_ms},
              {"backward_ms", l.backward_ms},
              {"bw_split", l.bw_split}};
    if (l.bw_split) {
      o["input_grad_ms"] = l.input_grad_ms;
      o["weight_grad_ms"] = l.weight_grad_ms;
    }
    o["activation_bytes"] = amount(l.activation_bytes);
    if (l.saved_bytes > 0) o["saved_bytes"] = amount(l.saved_bytes);
    if (l.bw_split && l.w_held_bytes >= 0) o["w_held_bytes"] = amount(l.w_held_bytes);
    o["parameter_bytes"] = amount(l.parameter_bytes);
    o["optimizer_bytes"] = amount(l.optimizer_bytes);
    if (l.optimizer_ms > 0) o["optimizer_ms"] = l.optimizer_ms;
    if (!l.by_micro_batch.empty()) {
      json sizes = json::array();
      for (const SizeMeasurement& s : l.by_micro_batch)
        sizes.push_back(
            {{"micro_batch_size", s.micro_batch_size}, {"forward_ms", s.forward_ms}, {"backward_ms", s.backward_ms}});
      o["by_micro_batch"] = sizes;
    }
    layers.push_back(o);
  }
  json j = {{"format", kProfileFormat},
            {"version", kProfileVersion},
            {"model", p.model},
            {"micro_batch_size", p.micro_batch_size},
            {"threads", p.threads}};
  if (!p.source.empty()) j["source"] = p.source;
  j["layers"] = layers;
  if (p.runtime) {
    const RuntimeCosts& rc = *p.runtime;
    json transfers = json::array();
    for (const TransferSample& t : rc.transfers)
      transfers.push_back({{"bytes", amount(t.bytes)}, {"one_way_ms", t.one_way_ms}});
    j["runtime"] = {{"transport", rc.transport},
                    {"latency_ms", rc.latency_ms},
                    {"bandwidth_bytes_per_ms", rc.bandwidth_bytes_per_ms},
                    {"overhead_ms", rc.overhead_ms},
                    {"transfers", transfers}};
    if (!rc.allreduce.empty()) {
      json samples = json::array();
      for (const TransferSample& t : rc.allreduce) samples.push_back({{"bytes", amount(t.bytes)}, {"ms", t.one_way_ms}});
      j["runtime"]["allreduce"] = {{"ranks", rc.allreduce_ranks}, {"samples", samples}};
    }
  }
  // The lowest version that holds what this profile has, so older readers still read what they can.
  const bool optimizer_times =
      std::any_of(p.layers.begin(), p.layers.end(), [](const LayerProfile& l) { return l.optimizer_ms > 0; }) ||
      (p.runtime && !p.runtime->allreduce.empty());
  j["version"] = optimizer_times ? 3 : p.runtime ? 2 : 1;
  return j;
}

Profile profile_from_json(const json& j, const std::string& origin) {
  const Reader r{origin};
  r.object(j, "the top level");
  r.only_keys(j, "the top level",
              {"format", "version", "model", "micro_batch_size", "threads", "source", "meta", "layers", "runtime"});
  const std::string format = r.text(j, "the top level", "format");
  if (format != kProfileFormat)
    fail(origin, "format", "is \"" + excerpt(format) + "\"",
         std::string("a pipetrain profile has \"format\": \"") + kProfileFormat +
             "\" (PipeDream's text profiles are read by load_profile / parse_pipedream_graph)");
  const json& version = r.field(j, "the top level", "version", "an integer");
  if (!version.is_number_integer())
    fail(origin, "version", "is " + json_excerpt(version), fmt::format("write \"version\": {}", kProfileVersion));
  if (version.get<long long>() < 1 || version.get<long long>() > kProfileVersion)
    fail(origin, "version", "is " + json_excerpt(version),
         fmt::format("this pipetrain reads versions 1..{}; a newer pipetrain wrote it, or the number is wrong",
                     kProfileVersion));
  Profile p;
  p.model = r.text(j, "the top level", "model");
  p.micro_batch_size = r.positive_int(j, "the top level", "micro_batch_size");
  p.threads = r.positive_int(j, "the top level", "threads");
  if (j.contains("source")) p.source = r.text(j, "the top level", "source");
  const json& layers = r.field(j, "the top level", "layers", "an array with one object per layer");
  if (!layers.is_array() || layers.empty())
    fail(origin, "layers", layers.is_array() ? "is empty" : "is " + std::string(layers.type_name()),
         "give an array with one object per layer, in model order");
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const json& o = layers[i];
    std::string at = fmt::format("layers[{}]", i);
    r.object(o, at);
    LayerProfile l;
    l.name = r.text(o, at, "name");
    at = layer_label(i, l.name);
    r.only_keys(o, at,
                {"name", "type", "forward_ms", "backward_ms", "bw_split", "input_grad_ms", "weight_grad_ms",
                 "activation_bytes", "saved_bytes", "w_held_bytes", "parameter_bytes", "optimizer_bytes",
                 "optimizer_ms", "by_micro_batch"});
    l.type = r.text(o, at, "type");
    l.forward_ms = r.number(o, at, "forward_ms", "milliseconds");
    l.backward_ms = r.number(o, at, "backward_ms", "milliseconds");
    if (o.contains("bw_split")) {
      if (!o["bw_split"].is_boolean())
        fail(origin, at + ".bw_split", "is " + json_excerpt(o["bw_split"]), "write true or false");
      l.bw_split = o["bw_split"].get<bool>();
    }
    if (l.bw_split) {
      l.input_grad_ms = r.number(o, at, "input_grad_ms", "milliseconds");
      l.weight_grad_ms = r.number(o, at, "weight_grad_ms", "milliseconds");
      if (o.contains("w_held_bytes")) l.w_held_bytes = r.number(o, at, "w_held_bytes", "bytes");
    } else {
      for (const char* key : {"input_grad_ms", "weight_grad_ms", "w_held_bytes"})
        if (o.contains(key))
          fail(origin, at + "." + key, "is given but bw_split is false or absent",
               "set \"bw_split\": true if the layer's backward splits into input and weight gradients, else drop it");
      l.input_grad_ms = l.backward_ms;
    }
    l.activation_bytes = r.number(o, at, "activation_bytes", "bytes");
    if (o.contains("saved_bytes")) l.saved_bytes = r.number(o, at, "saved_bytes", "bytes");
    l.parameter_bytes = r.number(o, at, "parameter_bytes", "bytes");
    l.optimizer_bytes = r.number(o, at, "optimizer_bytes", "bytes");
    if (o.contains("optimizer_ms")) {
      if (version.get<long long>() < 3)
        fail(origin, at + ".optimizer_ms", fmt::format("is given in a version {} profile", version.get<long long>()),
             "write \"version\": 3 (optimizer step times came with it)");
      l.optimizer_ms = r.number(o, at, "optimizer_ms", "milliseconds");
    }
    if (o.contains("by_micro_batch")) {
      const json& sizes = o["by_micro_batch"];
      if (!sizes.is_array())
        fail(origin, at + ".by_micro_batch", "is " + json_excerpt(sizes),
             "write an array of {\"micro_batch_size\", \"forward_ms\", \"backward_ms\"} objects");
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const std::string sat = fmt::format("{}.by_micro_batch[{}]", at, k);
        r.object(sizes[k], sat);
        r.only_keys(sizes[k], sat, {"micro_batch_size", "forward_ms", "backward_ms"});
        SizeMeasurement s;
        s.micro_batch_size = r.positive_int(sizes[k], sat, "micro_batch_size");
        s.forward_ms = r.number(sizes[k], sat, "forward_ms", "milliseconds");
        s.backward_ms = r.number(sizes[k], sat, "backward_ms", "milliseconds");
        l.by_micro_batch.push_back(s);
      }
    }
    p.layers.push_back(std::move(l));
  }
  if (j.contains("runtime")) {
    if (version.get<long long>() < 2)
      fail(origin, "runtime", "is given in a version 1 profile", "write \"version\": 2 (runtime costs came with it)");
    const json& o = j["runtime"];
    r.object(o, "runtime");
    r.only_keys(o, "runtime",
                {"transport", "latency_ms", "bandwidth_bytes_per_ms", "overhead_ms", "transfers", "allreduce"});
    RuntimeCosts rc;
    rc.transport = r.text(o, "runtime", "transport");
    rc.latency_ms = r.number(o, "runtime", "latency_ms", "milliseconds");
    rc.bandwidth_bytes_per_ms = r.number(o, "runtime", "bandwidth_bytes_per_ms", "bytes per millisecond");
    rc.overhead_ms = r.number(o, "runtime", "overhead_ms", "milliseconds");
    if (o.contains("transfers")) {
      const json& ts = o["transfers"];
      if (!ts.is_array())
        fail(origin, "runtime.transfers", "is " + json_excerpt(ts), "write an array of {\"bytes\", \"one_way_ms\"} objects");
      for (std::size_t k = 0; k < ts.size(); ++k) {
        const std::string at = fmt::format("runtime.transfers[{}]", k);
        r.object(ts[k], at);
        r.only_keys(ts[k], at, {"bytes", "one_way_ms"});
        rc.transfers.push_back(TransferSample{r.number(ts[k], at, "bytes", "bytes"),
                                              r.number(ts[k], at, "one_way_ms", "milliseconds")});
      }
    }
    if (o.contains("allreduce")) {
      if (version.get<long long>() < 3)
        fail(origin, "runtime.allreduce", fmt::format("is given in a version {} profile", version.get<long long>()),
             "write \"version\": 3 (measured all-reduces came with it)");
      const json& a = o["allreduce"];
      r.object(a, "runtime.allreduce");
      r.only_keys(a, "runtime.allreduce", {"ranks", "samples"});
      rc.allreduce_ranks = r.positive_int(a, "runtime.allreduce", "ranks");
      const json& ss = r.field(a, "runtime.allreduce", "samples", "an array of {\"bytes\", \"ms\"} objects");
      if (!ss.is_array() || ss.empty())
        fail(origin, "runtime.allreduce.samples", "is " + json_excerpt(ss), "write a non-empty array of {\"bytes\", \"ms\"} objects");
      for (std::size_t k = 0; k < ss.size(); ++k) {
        const std::string at = fmt::format("runtime.allreduce.samples[{}]", k);
        r.object(ss[k], at);
        r.only_keys(ss[k], at, {"bytes", "ms"});
        rc.allreduce.push_back(TransferSample{r.number(ss[k], at, "bytes", "bytes"), r.number(ss[k], at, "ms", "milliseconds")});
      }
    }
    p.runtime = std::move(rc);
  }
  validate_profile(p, origin);
  return p;
}

std::string profile_to_json_text(const Profile& p) { return profile_to_json(p).dump(2) + "\n"; }

Profile profile_from_json_text(const std::string& text, const std::string& origin) {
  return profile_from_json(parse_json_text(text, origin), origin);
}

// --- PipeDream's text format -----------------------------------------------------------------------
namespace {
struct PdNode {
  std::string id, desc;
  double f = 0, b = 0, act = 0, params = 0;
  int line = 0;
  long number = -1;  // K of "nodeK", -1 when the id has another form
};

double pd_number(const std::string& text, const std::string& origin, int line, const std::string& key) {
  const std::string t = trim(text);
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  if (t.empty() || end != t.c_str() + t.size() || !std::isfinite(v) || v < 0)
    throw UsageError(
        fmt::format("{}: line {}: {}=\"{}\" is not a non-negative number; fix the value", origin, line, key, t));
  return v;
}

PdNode parse_pd_node(const std::string& raw, const std::string& origin, int line) {
  const std::string expected =
      "expected 'nodeK -- <description> -- forward_compute_time=<ms>, backward_compute_time=<ms>, "
      "activation_size=<bytes>, parameter_size=<bytes>'";
  std::vector<std::string> tokens = split_on(raw, " -- ");
  if (tokens.size() >= 4 && trim(tokens.back()).rfind("stage_id=", 0) == 0) tokens.pop_back();  // planner output
  if (tokens.size() < 3) throw UsageError(fmt::format("{}: line {}: {}", origin, line, expected));
  PdNode n;
  n.line = line;
  n.id = trim(tokens.front());
  const std::string meta = tokens.back();
  for (std::size_t k = 1; k + 1 < tokens.size(); ++k) n.desc += (k > 1 ? " -- " : "") + tokens[k];
  n.desc = trim(n.desc);
  if (n.id.empty() || n.desc.empty()) throw UsageError(fmt::format("{}: line {}: {}", origin, line, expected));
  if (n.id.rfind("node", 0) == 0 && n.id.size() > 4 &&
      std::all_of(n.id.begin() + 4, n.id.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
  {
    if (n.id.size() > 4 + 18)  // std::stol would throw a bare "stol"
      throw UsageError(fmt::format("{}: line {}: node id {} has a number too large for 64 bits; number nodes "
                                   "node0, node1, ... (at most 18 digits)",
                                   origin, line, n.id));
    n.number = std::stol(n.id.substr(4));
  }
  std::map<std::string, std::string> kv;
  for (const std::string& item : split_on(meta, ", ")) {
    const std::size_t eq = item.find('=');
    if (eq == std::string::npos) throw UsageError(fmt::format("{}: line {}: '{}': {}", origin, line, item, expected));
    kv[trim(item.substr(0, eq))] = item.substr(eq + 1);
  }
  for (const char* key : {"forward_compute_time", "backward_compute_time", "activation_size", "parameter_size"})
    if (!kv.count(key)) throw UsageError(fmt::format("{}: line {}: no {}; {}", origin, line, key, expected));
  n.f = pd_number(kv["forward_compute_time"], origin, line, "forward_compute_time");
  n.b = pd_number(kv["backward_compute_time"], origin, line, "backward_compute_time");
  n.params = pd_number(kv["parameter_size"], origin, line, "parameter_size");
  std::string act = trim(kv["activation_size"]);
  if (!act.empty() && act.front() == '[') {  // several outputs: "[b1; b2]", summed as PipeDream does
    if (act.back() != ']')
      throw UsageError(fmt::format("{}: line {}: activation_size=\"{}\" lacks its ']'", origin, line, act));
    for (const std::string& part : split_on(act.substr(1, act.size() - 2), ";"))
      n.act += pd_number(part, origin, line, "activation_size");
  } else {
    n.act = pd_number(act, origin, line, "activation_size");
  }
  return n;
}

std::string type_of(const std::string& desc) {
  const std::string head = trim(desc.substr(0, desc.find('(')));
  return head.empty() ? desc : head;
}
}  // namespace

Profile parse_pipedream_graph(const std::string& text, const PipeDreamOptions& options, const std::string& origin) {
  std::vector<PdNode> nodes;
  std::map<std::string, std::size_t> index;
  std::vector<std::tuple<std::string, std::string, int>> edge_text;
  {
    std::istringstream in(text);
    std::string raw;
    int line = 0;
    while (std::getline(in, raw)) {
      ++line;
      if (!raw.empty() && raw.back() == '\r') raw.pop_back();
      if (trim(raw).empty()) continue;
      if (raw[0] == '\t' || raw[0] == ' ') {
        const std::vector<std::string> ends = split_on(trim(raw), " -- ");
        if (ends.size() != 2 || trim(ends[0]).empty() || trim(ends[1]).empty())
          throw UsageError(fmt::format("{}: line {}: an indented line is an edge 'nodeA -- nodeB', got '{}'", origin,
                                       line, trim(raw)));
        edge_text.emplace_back(trim(ends[0]), trim(ends[1]), line);
        continue;
      }
      PdNode n = parse_pd_node(raw, origin, line);
      if (index.count(n.id))
        throw UsageError(fmt::format("{}: line {}: node {} is defined again (first on line {}); each node once", origin,
                                     line, n.id, nodes[index[n.id]].line));
      index[n.id] = nodes.size();
      nodes.push_back(std::move(n));
    }
  }
  if (nodes.empty())
    throw UsageError(origin + ": no node lines; this does not look like a PipeDream profile (docs/PROFILE.md)");
  const std::size_t n = nodes.size();
  std::vector<std::set<std::size_t>> out(n), in(n);
  for (const auto& [a, b, line] : edge_text) {
    for (const std::string& id : {a, b})
      if (!index.count(id))
        throw UsageError(
            fmt::format("{}: line {}: edge names node {}, which has no node line; define it or drop "
                        "the edge",
                        origin, line, id));
    const std::size_t u = index[a], v = index[b];
    if (u == v) throw UsageError(fmt::format("{}: line {}: edge from {} to itself; drop it", origin, line, a));
    out[u].insert(v);
    in[v].insert(u);
  }
  // Drop what PipeDream's planner drops: Input sources and __getitem__ sinks.
  std::vector<bool> alive(n, true);
  for (std::size_t v = 0; v < n; ++v)
    if ((in[v].empty() && nodes[v].desc.rfind("Input", 0) == 0) ||
        (out[v].empty() && nodes[v].desc.rfind("__getitem__", 0) == 0))
      alive[v] = false;
  std::vector<int> indegree(n, 0);
  for (std::size_t v = 0; v < n; ++v)
    if (alive[v])
      for (std::size_t u : in[v]) indegree[v] += alive[u] ? 1 : 0;
  // Kahn's algorithm; ties by node number, then file order, so the order does not depend on how the
  // file happens to list the nodes.
  auto later = [&](std::size_t a, std::size_t b) {
    return std::make_tuple(nodes[a].number, a) > std::make_tuple(nodes[b].number, b);
  };
  std::priority_queue<std::size_t, std::vector<std::size_t>, decltype(later)> ready(later);
  std::size_t live = 0;
  for (std::size_t v = 0; v < n; ++v)
    if (alive[v]) {
      ++live;
      if (indegree[v] == 0) ready.push(v);
    }
  if (live == 0) throw UsageError(origin + ": only Input nodes; a profile needs at least one layer");
  std::vector<std::size_t> order;
  while (!ready.empty()) {
    const std::size_t v = ready.top();
    ready.pop();
    order.push_back(v);
    for (std::size_t w : out[v])
      if (alive[w] && --indegree[w] == 0) ready.push(w);
  }
  if (order.size() != live) {
    // Every node left has a predecessor left: walk back along those until a node repeats; the walk
    // from its first visit is a cycle, named node by node.
    std::size_t v = 0;
    while (!(alive[v] && indegree[v] > 0)) ++v;
    std::vector<std::size_t> walk;
    std::vector<long> seen(n, -1);
    while (seen[v] < 0) {
      seen[v] = static_cast<long>(walk.size());
      walk.push_back(v);
      for (std::size_t u : in[v])
        if (alive[u] && indegree[u] > 0) {
          v = u;
          break;
        }
    }
    std::string ordered;  // walk is backwards along edges: print forwards, from v
    std::vector<std::size_t> loop(walk.begin() + seen[v], walk.end());
    std::reverse(loop.begin(), loop.end());
    for (std::size_t u : loop) ordered += nodes[u].id + fmt::format(" (line {}) -> ", nodes[u].line);
    ordered += nodes[loop.front()].id;
    throw UsageError(fmt::format("{}: the graph has a cycle: {}; a profile must be a DAG: drop one of these edges",
                                 origin, ordered));
  }
  // All layers must hang together: a graph whose edge lines were lost would otherwise fold into one
  // layer, or split into unrelated pieces, without a word.
  if (live > 1) {
    std::vector<int> comp(n, -1);
    int comps = 0;
    std::vector<std::size_t> firsts;
    for (std::size_t s0 = 0; s0 < n; ++s0) {
      if (!alive[s0] || comp[s0] >= 0) continue;
      firsts.push_back(s0);
      std::vector<std::size_t> stack{s0};
      comp[s0] = comps;
      while (!stack.empty()) {
        const std::size_t u = stack.back();
        stack.pop_back();
        for (const auto* adj : {&out[u], &in[u]})
          for (std::size_t w : *adj)
            if (alive[w] && comp[w] < 0) comp[w] = comps, stack.push_back(w);
      }
      ++comps;
    }
    if (comps > 1) {
      std::string apart;
      int shown = 0;
      for (std::size_t v = 0; v < n && shown < 8; ++v)
        if (alive[v] && comp[v] != comp[firsts[0]]) apart += (shown++ ? ", " : "") + nodes[v].id;
      throw UsageError(fmt::format("{}: the graph falls into {} unconnected parts: node(s) {}{} have no edge path to "
                                   "{} (line {}); add the missing edge lines ('\tnodeA -- nodeB') or remove those nodes",
                                   origin, comps, apart, shown == 8 ? ", ..." : "", nodes[firsts[0]].id,
                                   nodes[firsts[0]].line));
    }
  }
  // A boundary after position c is kept iff exactly one tensor crosses it: the output of order[c].
  std::vector<std::size_t> pos(n, 0);
  for (std::size_t i = 0; i < order.size(); ++i) pos[order[i]] = i;
  std::vector<long> last_use(order.size(), -1);  // position of the last consumer of each node
  for (std::size_t i = 0; i < order.size(); ++i)
    for (std::size_t w : out[order[i]])
      if (alive[w]) last_use[i] = std::max(last_use[i], static_cast<long>(pos[w]));
  Profile p;
  p.model = options.model;
  p.micro_batch_size = options.micro_batch_size;
  p.threads = options.threads;
  p.source = "pipedream graph (" + origin + ")";
  LayerProfile cur;
  long reach_before = -1;  // furthest consumer of any node before position c
  for (std::size_t c = 0; c < order.size(); ++c) {
    const PdNode& node = nodes[order[c]];
    const bool first_in_layer = cur.name.empty();
    cur.name += (first_in_layer ? "" : "+") + node.id;
    cur.type += (first_in_layer ? "" : "+") + type_of(node.desc);
    cur.forward_ms += node.f;
    cur.backward_ms += node.b;
    cur.parameter_bytes += node.params;
    cur.activation_bytes = node.act;
    const long here = static_cast<long>(c);
    if (options.planner_states) {  // every cut is a state; what crosses it is every output used later
      double crossing = 0;
      for (std::size_t u = 0; u <= c; ++u)
        if (last_use[u] > here) crossing += nodes[order[u]].act;
      if (c + 1 < order.size()) cur.activation_bytes = crossing;
      cur.optimizer_bytes = cur.parameter_bytes * options.optimizer_bytes_per_parameter_byte;
      p.layers.push_back(cur);
      cur = LayerProfile{};
      continue;
    }
    const bool clean = c + 1 == order.size() || (last_use[c] > here && reach_before <= here);
    reach_before = std::max(reach_before, last_use[c]);
    if (clean) {
      cur.optimizer_bytes = cur.parameter_bytes * options.optimizer_bytes_per_parameter_byte;
      p.layers.push_back(cur);
      cur = LayerProfile{};
    }
  }
  normalise_bw_split(p);
  validate_profile(p, origin);
  return p;
}

Profile load_pipedream_graph(const std::string& path, const PipeDreamOptions& options) {
  return parse_pipedream_graph(read_whole_file(path), options, path);
}

Profile load_profile(const std::string& path) {
  const std::string text(skip_utf8_bom(read_whole_file(path)));
  const std::size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && text[first] == '{') return profile_from_json_text(text, path);
  return parse_pipedream_graph(text, PipeDreamOptions{}, path);
}

void save_profile(const std::string& path, const Profile& profile) {
  validate_profile(profile, path);
  write_file_atomic(path, profile_to_json_text(profile));
}

std::vector<double> forward_plus_backward_ms(const Profile& profile) {
  std::vector<double> out;
  out.reserve(profile.layers.size());
  for (const LayerProfile& l : profile.layers) out.push_back(l.forward_ms + l.backward_ms);
  return out;
}

}  // namespace pipetrain

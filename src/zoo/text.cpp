// Character-level text data (zoo/data.h): vocabulary, encoding, random training windows, the King James
// Bible through Debian's bible-kjv.
#include <ATen/CPUGeneratorImpl.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "pipetrain/core/error.h"
#include "pipetrain/zoo/data.h"
#include "seeded.h"

namespace pipetrain::zoo {
namespace {


// "'a' (byte 0x61)", or just the byte for characters that do not print.
std::string describe_char(unsigned char c) {
  char buf[32];
  if (c >= 0x20 && c < 0x7f)
    std::snprintf(buf, sizeof buf, "'%c' (byte 0x%02x)", c, c);
  else
    std::snprintf(buf, sizeof buf, "byte 0x%02x", c);
  return buf;
}

// The checks both text data sets make of their arguments.
void check_text_args(const std::string& name, int64_t seq_len, double eval_fraction) {
  if (seq_len < 1) throw UsageError("--seq-len " + std::to_string(seq_len) + " must be >= 1");
  if (!(eval_fraction >= 0 && eval_fraction < 1))
    throw UsageError("held-out fraction " + std::to_string(eval_fraction) + " of text '" + name + "' must lie in [0, 1)");
}

// The sorted distinct bytes of `text`: token id k is its k-th character.
std::string vocabulary_of(const std::string& text) {
  std::array<bool, 256> seen{};
  for (char c : text) seen[static_cast<unsigned char>(c)] = true;
  std::string v;
  for (int b = 0; b < 256; ++b)
    if (seen[b]) v.push_back(static_cast<char>(b));
  return v;
}

class Text : public Dataset {
 public:
  Text(const std::string& text, std::string name, int64_t seq_len, uint64_t seed, double eval_fraction)
      : name_(std::move(name)), seq_len_(seq_len), seed_(seed) {
    check_text_args(name_, seq_len, eval_fraction);
    vocabulary_ = vocabulary_of(text);
    tokens_ = encode_text(vocabulary_, text);
    const int64_t length = static_cast<int64_t>(text.size());
    eval_chars_ = static_cast<int64_t>(std::floor(eval_fraction * static_cast<double>(length)));
    train_chars_ = length - eval_chars_;
    if (train_chars_ < seq_len + 1)
      throw UsageError("text '" + name_ + "' has " + std::to_string(train_chars_) +
                       " training characters, fewer than one window of --seq-len + 1 = " + std::to_string(seq_len + 1) +
                       ": use a longer text or a smaller --seq-len");
    if (eval_chars_ > 0 && eval_chars_ < seq_len + 1) {
      // The fix in numbers: the text that holds out one window at this fraction, or the context that fits.
      const auto needed = static_cast<int64_t>(std::ceil(static_cast<double>(seq_len + 1) / eval_fraction));
      throw UsageError("text '" + name_ + "' holds out " + std::to_string(eval_chars_) + " of its " +
                       std::to_string(length) + " characters (" + fmt::format("{:g}", 100 * eval_fraction) +
                       "%) for evaluation, fewer than one window of --seq-len + 1 = " + std::to_string(seq_len + 1) +
                       ": use a text of at least " + std::to_string(needed) + " characters" +
                       (eval_chars_ >= 2 ? ", or --seq-len " + std::to_string(eval_chars_ - 1) + " or less" : ""));
    }
  }

  std::string name() const override { return name_; }
  std::string vocabulary() const override { return vocabulary_; }
  int64_t train_size() const override { return train_chars_ / seq_len_; }
  int64_t eval_size() const override { return eval_chars_ > 0 ? (eval_chars_ - 1) / seq_len_ : 0; }

  Batch batch(int64_t step, int64_t batch_size) override {
    if (step < 0) throw UsageError("batch step " + std::to_string(step) + " must be >= 0");
    if (batch_size < 1) throw UsageError("batch size " + std::to_string(batch_size) + " must be >= 1");
    at::Generator g = seeded_generator(seed_, static_cast<uint64_t>(step));
    // train_chars_ - seq_len_ windows of seq_len_ + 1 tokens fit inside the training part.
    torch::Tensor starts = torch::randint(train_chars_ - seq_len_, {batch_size}, g, torch::kLong);
    return windows(starts);
  }

  Batch eval_batch(int64_t begin, int64_t count) override {
    const int64_t m = eval_size();
    if (begin < 0 || count < 0 || begin > m - count)
      throw UsageError("held-out windows [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                       ") are outside the " + std::to_string(m) + " of text '" + name_ + "': use a range in [0, " +
                       std::to_string(m) + ")");
    return windows(train_chars_ + torch::arange(begin, begin + count, torch::kLong) * seq_len_);
  }

 private:
  // Windows of seq_len_ + 1 tokens at `starts` (positions in the whole text), split into input and target.
  Batch windows(const torch::Tensor& starts) const {
    const int64_t b = starts.size(0);
    torch::Tensor index = starts.unsqueeze(1) + torch::arange(seq_len_ + 1, torch::kLong).unsqueeze(0);
    torch::Tensor w = tokens_.index_select(0, index.flatten()).view({b, seq_len_ + 1});
    return {w.slice(1, 0, seq_len_).contiguous(), w.slice(1, 1, seq_len_ + 1).contiguous()};
  }

  std::string name_;
  int64_t seq_len_;
  uint64_t seed_;
  std::string vocabulary_;
  torch::Tensor tokens_;  // int64 [text length]; the training part first, then the held-out part
  int64_t train_chars_ = 0, eval_chars_ = 0;
};

// Lines as samples (make_text_lines).
class TextLines : public Dataset {
 public:
  TextLines(const std::string& text, std::string name, int64_t seq_len, uint64_t seed, double eval_fraction)
      : name_(std::move(name)), seq_len_(seq_len), seed_(seed) {
    check_text_args(name_, seq_len, eval_fraction);
    vocabulary_ = vocabulary_of(text);
    tokens_ = encode_text(vocabulary_, text);
    const auto piece = static_cast<std::size_t>(seq_len + 1);
    for (std::size_t begin = 0; begin < text.size();) {
      std::size_t end = text.find('\n', begin);
      end = end == std::string::npos ? text.size() : end + 1;
      for (std::size_t at = begin; at < end; at += piece) {
        const std::size_t len = std::min(piece, end - at);
        if (len >= 2) samples_.emplace_back(static_cast<int64_t>(at), static_cast<int64_t>(len));
      }
      begin = end;
    }
    eval_ = static_cast<int64_t>(std::floor(eval_fraction * static_cast<double>(samples_.size())));
    train_ = static_cast<int64_t>(samples_.size()) - eval_;
    if (train_ < 1)
      throw UsageError("text '" + name_ + "' has no line of 2 or more characters to train on: use another text");
    // As Text refuses a held-out part shorter than one window: with none held out, evaluation and the
    // sample did nothing, without a word.
    if (eval_fraction > 0 && eval_ < 1) {
      const auto needed = static_cast<int64_t>(std::ceil(1.0 / eval_fraction));
      throw UsageError("text '" + name_ + "' has " + std::to_string(samples_.size()) + " line pieces of 2 or more "
                       "characters, and holding out " + fmt::format("{:g}", 100 * eval_fraction) +
                       "% of them for evaluation leaves none: use a text of at least " + std::to_string(needed) +
                       " such lines (each line is a sample, cut into pieces of --seq-len + 1 characters)");
    }
  }

  std::string name() const override { return name_; }
  std::string vocabulary() const override { return vocabulary_; }
  int64_t train_size() const override { return train_; }
  int64_t eval_size() const override { return eval_; }

  Batch batch(int64_t step, int64_t batch_size) override {
    if (step < 0) throw UsageError("batch step " + std::to_string(step) + " must be >= 0");
    if (batch_size < 1) throw UsageError("batch size " + std::to_string(batch_size) + " must be >= 1");
    at::Generator g = seeded_generator(seed_, static_cast<uint64_t>(step));
    return samples(torch::randint(train_, {batch_size}, g, torch::kLong));
  }

  Batch eval_batch(int64_t begin, int64_t count) override {
    if (begin < 0 || count < 0 || begin > eval_ - count)
      throw UsageError("held-out samples [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                       ") are outside the " + std::to_string(eval_) + " of text '" + name_ + "': use a range in [0, " +
                       std::to_string(eval_) + ")");
    return samples(train_ + torch::arange(begin, begin + count, torch::kLong));
  }

 private:
  Batch samples(const torch::Tensor& which) const {
    const int64_t b = which.size(0);
    Batch out{torch::zeros({b, seq_len_}, torch::kLong), torch::full({b, seq_len_}, -1, torch::kLong),
              torch::zeros({b, seq_len_}, torch::kBool)};
    const auto* w = which.data_ptr<int64_t>();
    for (int64_t k = 0; k < b; ++k) {
      const auto [at, len] = samples_[static_cast<std::size_t>(w[k])];
      out.input[k].slice(0, 0, len - 1).copy_(tokens_.slice(0, at, at + len - 1));
      out.target[k].slice(0, 0, len - 1).copy_(tokens_.slice(0, at + 1, at + len));
      out.mask[k].slice(0, 0, len - 1).fill_(true);
    }
    return out;
  }

  std::string name_;
  int64_t seq_len_;
  uint64_t seed_;
  std::string vocabulary_;
  torch::Tensor tokens_;
  std::vector<std::pair<int64_t, int64_t>> samples_;  // (first character, length) of each sample
  int64_t train_ = 0, eval_ = 0;
};

// True for a bible-kjv verse reference such as "Ge1:1", "1Chr12:40" or "Rev22:21": an optional digit,
// letters, digits, ':', digits.
bool is_reference(const std::string& s) {
  std::size_t i = 0;
  if (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
  const std::size_t letters = i;
  while (i < s.size() && std::isalpha(static_cast<unsigned char>(s[i]))) ++i;
  if (i == letters) return false;
  const std::size_t chapter = i;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
  if (i == chapter || i == s.size() || s[i] != ':') return false;
  const std::size_t verse = ++i;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
  return i > verse && i == s.size();
}

// The executable `program` resolves to (as the shell would find it), or "" if there is none.
std::string find_program(const std::string& program) {
  if (program.find('/') != std::string::npos) return access(program.c_str(), X_OK) == 0 ? program : "";
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/local/bin:/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace

std::unique_ptr<Dataset> make_text(const std::string& text, const std::string& name, int64_t seq_len, uint64_t seed,
                                   double eval_fraction) {
  return std::make_unique<Text>(text, name, seq_len, seed, eval_fraction);
}

std::unique_ptr<Dataset> make_text_lines(const std::string& text, const std::string& name, int64_t seq_len,
                                         uint64_t seed, double eval_fraction) {
  return std::make_unique<TextLines>(text, name, seq_len, seed, eval_fraction);
}

torch::Tensor encode_text(const std::string& vocabulary, const std::string& s) {
  std::array<int64_t, 256> id;
  id.fill(-1);
  for (std::size_t k = 0; k < vocabulary.size(); ++k) {
    const unsigned char c = static_cast<unsigned char>(vocabulary[k]);
    if (id[c] >= 0)
      throw UsageError("the vocabulary lists character " + describe_char(c) + " twice (at " + std::to_string(id[c]) +
                       " and " + std::to_string(k) + "): pass distinct characters");
    id[c] = static_cast<int64_t>(k);
  }
  torch::Tensor out = torch::empty({static_cast<int64_t>(s.size())}, torch::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (std::size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (id[c] < 0)
      throw UsageError("character " + describe_char(c) + " at position " + std::to_string(i) +
                       " is not in the vocabulary of " + std::to_string(vocabulary.size()) +
                       " characters: use text made of the vocabulary the model was trained on");
    p[i] = id[c];
  }
  return out;
}

std::string decode_text(const std::string& vocabulary, const torch::Tensor& ids) {
  const torch::Tensor flat = ids.to(torch::kCPU, torch::kLong).contiguous().flatten();
  const int64_t* p = flat.data_ptr<int64_t>();
  const int64_t v = static_cast<int64_t>(vocabulary.size());
  std::string out(static_cast<std::size_t>(flat.numel()), '\0');
  for (int64_t i = 0; i < flat.numel(); ++i) {
    if (p[i] < 0 || p[i] >= v)
      throw UsageError("token id " + std::to_string(p[i]) + " at position " + std::to_string(i) +
                       " is outside the vocabulary of " + std::to_string(v) + " characters: ids must lie in [0, " +
                       std::to_string(v) + ")");
    out[static_cast<std::size_t>(i)] = vocabulary[static_cast<std::size_t>(p[i])];
  }
  return out;
}

std::string load_kjv(const std::string& program) {
  const std::string fix =
      "install the Debian package bible-kjv (apt-get install bible-kjv) or pass a text file with --text FILE";
  if (find_program(program).empty()) throw UsageError("program '" + program + "' not found: " + fix);
  const std::string command = shell_quote(program) + " -f Gen1:1-Rev22:21";
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) throw UsageError("cannot run " + command + ": " + std::strerror(errno) + ": " + fix);
  std::string raw;
  char buf[1 << 16];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) raw.append(buf, n);
  const int status = pclose(pipe);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw UsageError(command + " failed (" +
                     (status != -1 && WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                                                        : std::string("killed or not waited for")) +
                     "): " + fix);
  // bible prints "Bad Book" and exits 0 when its data files do not match, so check the first verse too.
  if (raw.compare(0, 6, "Ge1:1 ") != 0)
    throw UsageError(command + " did not print Genesis 1:1 first (it printed \"" + raw.substr(0, 60) +
                     "\"): reinstall bible-kjv or pass a text file with --text FILE");
  std::string text;
  text.reserve(raw.size());
  std::size_t begin = 0;
  while (begin < raw.size()) {
    std::size_t end = raw.find('\n', begin);
    if (end == std::string::npos) end = raw.size();
    std::size_t start = begin;
    const std::size_t space = raw.find(' ', begin);
    if (space < end && is_reference(raw.substr(begin, space - begin))) start = space + 1;
    text.append(raw, start, end - start);
    text.push_back('\n');
    begin = end + 1;
  }
  return text;
}

std::string read_text_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw UsageError("text file " + path +
                     " does not exist or is not a regular file: pass an existing file "
                     "with --text FILE");
  // Every rank holds the whole text, and its token ids (8 bytes a character): about 10 bytes of memory per
  // byte of text per rank. A larger file (a 20 GB one was read whole) is refused before it is read.
  const auto size = std::filesystem::file_size(path, ec);
  if (!ec && size > kMaxTextBytes)
    throw UsageError("text file " + path + " has " + std::to_string(size) + " bytes; a text is held in memory on every "
                     "rank (about 10 bytes per character), at most " + std::to_string(kMaxTextBytes >> 20) +
                     " MiB: train on a part of it, e.g. head -c 256M " + path + " > part.txt");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("cannot open text file " + path + ": " + std::strerror(errno) + ": check its permissions");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw UsageError("cannot read text file " + path + ": " + std::strerror(errno));
  if (text.str().empty()) throw UsageError("text file " + path + " is empty: pass a file with some text");
  return text.str();
}

}  // namespace pipetrain::zoo

// A group view of a transport (transport.h make_group_transport): ranks renumbered within the group,
// point-to-point passed through, collectives built from point-to-point messages between the members.
//
// all_reduce_sum of n members: a reduce-scatter, then an all-gather, each one direct exchange. The
// tensor is cut into n chunks of (nearly) equal size; member i receives chunk i of every other member,
// sums the n contributions in member order, and sends that sum to every other member. Every member thus
// sends and receives 2 (n - 1) / n of the tensor (as a ring does, in 2 rounds of concurrent messages
// rather than 2 (n - 1) steps), and adds 1/n of it. Each element is summed once, by its chunk's owner,
// always in member order (member 0's value + member 1's + ...): every member gets bitwise the same
// result, the same as a sum in member order through one member, and the same from run to run.
#include <algorithm>

#include "pipetrain/core/error.h"
#include "pipetrain/runtime/transport.h"

namespace pipetrain {
namespace {

class GroupTransport : public Transport {
 public:
  GroupTransport(std::shared_ptr<Transport> base, std::vector<int> members, int collective_tag)
      : base_(std::move(base)), members_(std::move(members)), tag_(collective_tag) {
    const auto it = std::find(members_.begin(), members_.end(), base_->rank());
    rank_ = static_cast<int>(it - members_.begin());
  }
  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(members_.size()); }
  std::string name() const override { return base_->name(); }
  bool shares_process() const override { return base_->shares_process(); }
  std::unique_ptr<Work> isend(const torch::Tensor& tensor, int dst, int tag) override {
    return base_->isend(tensor, member(dst), tag);
  }
  std::unique_ptr<Work> irecv(torch::Tensor& tensor, int src, int tag) override {
    return base_->irecv(tensor, member(src), tag);
  }
  void all_reduce_sum(torch::Tensor& tensor) override {
    const int n = world_size();
    if (n == 1) return;
    torch::NoGradGuard no_grad;
    torch::Tensor t = tensor.contiguous();  // `tensor` itself when it is contiguous: reduced in place
    torch::Tensor flat = t.view({-1});
    const int64_t total = flat.numel();
    // chunk i: [begin(i), begin(i + 1)); empty chunks (a tensor of fewer than n elements) send nothing.
    auto begin = [&](int i) { return total * i / n; };
    auto chunk = [&](int i) { return flat.slice(0, begin(i), begin(i + 1)); };
    const auto me = static_cast<std::size_t>(rank_);
    const int64_t mine = begin(rank_ + 1) - begin(rank_);
    // The tensors handed to isend/irecv live in these vectors, sized before any is posted (a receive may
    // hold a reference to its tensor until wait()).
    std::vector<torch::Tensor> incoming(static_cast<std::size_t>(n)), outgoing(static_cast<std::size_t>(n));
    std::vector<std::unique_ptr<Work>> works;
    works.reserve(2 * static_cast<std::size_t>(n));
    auto finish = [&] {
      for (auto& w : works) w->wait();
      works.clear();
    };
    // Reduce-scatter: every other member's share of my chunk in, my share of theirs out.
    for (int j = 0; j < n; ++j) {
      if (j == rank_ || mine == 0) continue;
      incoming[static_cast<std::size_t>(j)] = torch::empty({mine}, flat.options());
      works.push_back(base_->irecv(incoming[static_cast<std::size_t>(j)], members_[static_cast<std::size_t>(j)], tag_));
    }
    for (int j = 0; j < n; ++j) {
      if (j == rank_ || begin(j + 1) == begin(j)) continue;
      outgoing[static_cast<std::size_t>(j)] = chunk(j);
      works.push_back(base_->isend(outgoing[static_cast<std::size_t>(j)], members_[static_cast<std::size_t>(j)], tag_));
    }
    finish();
    if (mine > 0) {
      // Member order: accumulate into member 0's contribution (my chunk itself when I am member 0).
      torch::Tensor own = chunk(rank_);
      torch::Tensor& acc = rank_ == 0 ? own : incoming[0];
      for (int j = 1; j < n; ++j) acc.add_(j == rank_ ? own : incoming[static_cast<std::size_t>(j)]);
      if (rank_ != 0) own.copy_(acc);
    }
    // All-gather: my chunk's sum out to everyone, theirs straight into their places.
    for (int j = 0; j < n; ++j) {
      if (j == rank_ || begin(j + 1) == begin(j)) continue;
      incoming[static_cast<std::size_t>(j)] = chunk(j);
      works.push_back(base_->irecv(incoming[static_cast<std::size_t>(j)], members_[static_cast<std::size_t>(j)], tag_));
    }
    if (mine > 0) {
      outgoing[me] = chunk(rank_);
      for (int j = 0; j < n; ++j)
        if (j != rank_) works.push_back(base_->isend(outgoing[me], members_[static_cast<std::size_t>(j)], tag_));
    }
    finish();
    if (!t.is_same(tensor)) tensor.copy_(t);
  }
  void barrier() override {
    torch::Tensor one = torch::ones({1}, torch::kDouble);
    all_reduce_sum(one);
  }
  void abort(const std::string& message) noexcept override { base_->abort(message); }

 private:
  int member(int r) const {
    if (r < 0 || r >= world_size())
      throw std::out_of_range("group rank " + std::to_string(r) + " outside a group of " + std::to_string(world_size()));
    return members_[static_cast<std::size_t>(r)];
  }
  std::shared_ptr<Transport> base_;
  std::vector<int> members_;
  int tag_;
  int rank_ = 0;
};

}  // namespace

std::shared_ptr<Transport> make_group_transport(std::shared_ptr<Transport> base, const std::vector<int>& members,
                                                int collective_tag) {
  if (!base) throw std::invalid_argument("make_group_transport: no base transport");
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  if (members.empty() || std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end() || sorted.front() < 0 ||
      sorted.back() >= base->world_size())
    throw UsageError("a transport group needs distinct ranks in [0, " + std::to_string(base->world_size()) + ")");
  if (std::find(members.begin(), members.end(), base->rank()) == members.end())
    throw UsageError("rank " + std::to_string(base->rank()) + " is not a member of the transport group it opens");
  return std::make_shared<GroupTransport>(std::move(base), members, collective_tag);
}

}  // namespace pipetrain

// A group view of a transport (transport.h make_group_transport): ranks renumbered within the group,
// point-to-point passed through, collectives built from point-to-point messages to the group's first
// member and back.
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
  // Sum at the first member, in member order (so every group sums in the same order: deterministic),
  // then the result back to every member.
  void all_reduce_sum(torch::Tensor& tensor) override {
    const int n = world_size();
    if (n == 1) return;
    torch::Tensor t = tensor.contiguous();
    if (rank_ == 0) {
      torch::Tensor sum = t.clone();
      torch::Tensor buf = torch::empty_like(t);
      for (int r = 1; r < n; ++r) {
        base_->recv(buf, members_[static_cast<std::size_t>(r)], tag_);
        sum.add_(buf);
      }
      for (int r = 1; r < n; ++r) base_->send(sum, members_[static_cast<std::size_t>(r)], tag_);
      tensor.copy_(sum);
    } else {
      base_->send(t, members_[0], tag_);
      torch::Tensor sum = torch::empty_like(t);
      base_->recv(sum, members_[0], tag_);
      tensor.copy_(sum);
    }
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

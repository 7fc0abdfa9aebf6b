#include "lease_table.h"

#include <algorithm>
#include <iterator>

namespace wsync::control {

using wsync::store::v1::Record;
using wsync::v1::Lease;

StatusOr<Lease> LeaseTable::Acquire(const std::string& node, uint64_t version, uint64_t ttl_ms,
                                    const std::string& request_id, const RecordLog& log) {
  if (!request_id.empty()) {
    if (auto it = by_request_.find({node, request_id}); it != by_request_.end()) return leases_.at(it->second);
  }
  return Grant(next_lease_id_, node, version, ttl_ms, request_id, log);
}

StatusOr<Lease> LeaseTable::Renew(uint64_t id, uint64_t ttl_ms, const RecordLog& log) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return NotFoundError("lease " + std::to_string(id) + " is not held (expired or released)");
  return Grant(id, it->second.node(), it->second.version(), ttl_ms, it->second.request_id(), log);
}

StatusOr<Lease> LeaseTable::Grant(uint64_t id, const std::string& node, uint64_t version, uint64_t ttl_ms,
                                  const std::string& request_id, const RecordLog& log) {
  Record r;
  Lease* l = r.mutable_lease_granted();
  l->set_id(id);
  l->set_node(node);
  l->set_version(version);
  l->set_request_id(request_id);
  l->set_expires_unix_ms(clock_->NowMs() + static_cast<int64_t>(ttl_ms ? ttl_ms : default_ttl_ms_));
  WSYNC_RETURN_IF_ERROR(log(r));
  return leases_.at(id);
}

Status LeaseTable::Release(uint64_t id, const RecordLog& log) {
  if (!leases_.count(id)) return NotFoundError("lease " + std::to_string(id) + " is not held");
  Record r;
  r.set_lease_released(id);
  return log(r);
}

void LeaseTable::ApplyGranted(const Lease& lease) {
  leases_[lease.id()] = lease;
  if (!lease.request_id().empty()) by_request_[{lease.node(), lease.request_id()}] = lease.id();
  next_lease_id_ = std::max(next_lease_id_, lease.id() + 1);
}

void LeaseTable::Erase(std::map<uint64_t, Lease>::iterator it) {
  if (!it->second.request_id().empty()) by_request_.erase({it->second.node(), it->second.request_id()});
  leases_.erase(it);
}

void LeaseTable::ApplyReleased(uint64_t id) {
  if (auto it = leases_.find(id); it != leases_.end()) Erase(it);
}

void LeaseTable::DropNode(const std::string& node) {
  for (auto it = leases_.begin(); it != leases_.end();) {
    auto next = std::next(it);
    if (it->second.node() == node) Erase(it);
    it = next;
  }
}

std::vector<uint64_t> LeaseTable::Ended(int64_t now, const std::function<bool(const std::string& node)>& owner_dead) const {
  std::vector<uint64_t> ended;
  for (const auto& [id, l] : leases_) {
    if (owner_dead(l.node()) || now > l.expires_unix_ms()) ended.push_back(id);
  }
  return ended;
}

uint64_t LeaseTable::OldestLeased() const {
  uint64_t oldest = 0;
  for (const auto& [id, l] : leases_) oldest = oldest == 0 ? l.version() : std::min(oldest, l.version());
  return oldest;
}

wsync::v1::ListLeasesResponse LeaseTable::List() const {
  wsync::v1::ListLeasesResponse resp;
  for (const auto& [id, l] : leases_) *resp.add_leases() = l;
  resp.set_oldest_leased_version(OldestLeased());
  return resp;
}

void LeaseTable::SaveTo(wsync::store::v1::Snapshot* snapshot) const {
  for (const auto& [id, l] : leases_) *snapshot->add_leases() = l;
  snapshot->set_next_lease_id(next_lease_id_);
}

void LeaseTable::LoadFrom(const wsync::store::v1::Snapshot& snapshot) {
  for (const auto& l : snapshot.leases()) ApplyGranted(l);
  next_lease_id_ = std::max(next_lease_id_, snapshot.next_lease_id());
}

}  // namespace wsync::control

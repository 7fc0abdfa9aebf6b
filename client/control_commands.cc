#include "control_commands.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>

#include "json_output.h"
#include "wsync/control/client.h"
#include "wsync/control/server.h"
#include "wsync/util/text.h"

namespace wsync::cli {
namespace {

namespace v1 = wsync::v1;

struct Connection {
  std::string coordinator;
  std::string token_file;
  std::string tls_ca, tls_cert, tls_key, tls_server_name;
  int timeout_ms = 5000;
  bool json = false;
};

void AddConnectionFlags(CLI::App* cmd, Connection* c) {
  cmd->add_option("--coordinator", c->coordinator, "host:port or unix:PATH, or replicas: a comma-separated list (env WSYNC_COORDINATOR)");
  cmd->add_option("--token-file", c->token_file, "bearer token file (or env WSYNC_TOKEN)");
  cmd->add_option("--tls-ca", c->tls_ca, "CA certificate: connect with TLS");
  cmd->add_option("--tls-cert", c->tls_cert, "client certificate (mTLS)");
  cmd->add_option("--tls-key", c->tls_key, "client key (mTLS)");
  cmd->add_option("--tls-server-name", c->tls_server_name, "name expected in the server certificate");
  cmd->add_option("--timeout-ms", c->timeout_ms, "per-call deadline");
  cmd->add_flag("--json", c->json, "machine-readable output");
}

// --coordinator, else WSYNC_COORDINATOR.
std::string CoordinatorAddress(const Connection& c) {
  if (!c.coordinator.empty()) return c.coordinator;
  const char* env = std::getenv("WSYNC_COORDINATOR");
  return env ? env : "";
}

StatusOr<std::unique_ptr<control::CoordinatorClient>> Connect(const Connection& c) {
  control::ClientOptions o;
  o.address = CoordinatorAddress(c);
  if (!c.token_file.empty()) {
    WSYNC_ASSIGN_OR_RETURN(o.token, control::ReadTokenFile(c.token_file));
  } else if (const char* env = std::getenv("WSYNC_TOKEN")) {
    o.token = env;
  }
  o.tls_ca_file = c.tls_ca;
  o.tls_cert_file = c.tls_cert;
  o.tls_key_file = c.tls_key;
  o.tls_server_name = c.tls_server_name;
  o.timeout_ms = c.timeout_ms;
  return control::NewCoordinatorClient(o);
}


std::string Ago(int64_t then_ms, int64_t now_ms) {
  if (then_ms == 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1fs ago", (now_ms - then_ms) / 1000.0);
  return buf;
}

std::string RoleName(v1::Role r) {
  switch (r) {
    case v1::ROLE_SOURCE: return "source";
    case v1::ROLE_SINK: return "sink";
    case v1::ROLE_COORDINATOR_CLIENT: return "client";
    default: return "?";
  }
}

void PrintNodes(const v1::StatusResponse& s) {
  std::printf("%-24s %-7s %-6s %-21s %8s %9s %-16s %-12s\n", "NODE", "ROLE", "STATE", "HOST", "APPLIED", "STALENESS",
              "PARENT", "HEARTBEAT");
  for (const auto& n : s.nodes()) {
    const bool sink = n.role() == v1::ROLE_SINK;
    std::printf("%-24s %-7s %-6s %-21s %8s %9s %-16s %-12s%s\n", n.name().c_str(), RoleName(n.role()).c_str(),
                n.state() == v1::NODE_ALIVE ? "alive" : n.state() == v1::NODE_DISCONNECTED ? "gone" : "dead",
                n.host().c_str(),
                sink ? std::to_string(n.applied_version()).c_str() : "-",
                sink ? std::to_string(n.staleness()).c_str() : "-", n.parent().empty() ? "-" : n.parent().c_str(),
                Ago(n.last_heartbeat_unix_ms(), s.now_unix_ms()).c_str(),
                n.resync_keyframe() ? "  (resync from keyframe)" : n.holds_pieces() ? "  (holds pieces)" : "");
    if (n.active_holds() > 0) {
      std::printf("    %u hold(s) active, the oldest for %.1f s\n", n.active_holds(), n.oldest_hold_ms() / 1000.0);
    }
    if (!n.sync_error().empty()) std::printf("    cannot sync: %s\n", n.sync_error().c_str());
  }
  uint64_t paced = 0;
  for (const auto& n : s.nodes()) paced = std::max(paced, n.heartbeat_interval_ms());
  if (paced > 0) {
    std::printf("sinks paced past the coordinator's heartbeat budget: a heartbeat every %.1f s each, dead after "
                "four missed\n",
                paced / 1000.0);
  }
}

void PrintLeases(const google::protobuf::RepeatedPtrField<v1::Lease>& leases, int64_t now_ms) {
  std::printf("%-8s %-24s %8s %12s\n", "LEASE", "NODE", "VERSION", "EXPIRES IN");
  for (const auto& l : leases) {
    std::printf("%-8" PRIu64 " %-24s %8" PRIu64 " %11.1fs\n", l.id(), l.node().c_str(), l.version(),
                (l.expires_unix_ms() - now_ms) / 1000.0);
  }
}

// Versions some of whose parts are announced (several sources), one line each.
void PrintPartial(const v1::ListVersionsResponse& v) {
  for (const auto& s : v.partial()) {
    std::string in;
    for (const auto& p : s.part_summaries()) {
      in += (in.empty() ? "" : ", ") + std::to_string(p.part()) + " by " + p.source();
    }
    std::printf("version %" PRIu64 ": partial, %d of %u parts announced (%s); invisible to sinks until every part is\n",
                s.version(), s.part_summaries_size(), s.parts(), in.c_str());
  }
}

// The published layout in one line: its tensors, who set it, and how many
// carry tile grids (for the sinks holding pieces of the layouts served).
void PrintLayout(const v1::GetLayoutResponse& l) {
  if (!l.set()) {
    std::printf("layout: none yet (no source has published)\n");
    return;
  }
  const v1::Layout& layout = l.layout();
  int gridded = 0;
  for (const auto& t : layout.tensors()) gridded += t.row_cuts_size() > 0 || t.col_cuts_size() > 0;
  std::string by = layout.source();
  if (layout.parts() > 1) {
    by.clear();
    for (const auto& s : layout.part_sources()) by += (by.empty() ? "" : ", ") + (s.empty() ? "-" : s);
    by = std::to_string(layout.parts()) + " sources (" + by + ")";
  }
  std::printf("layout: %d tensors by %s", layout.tensors_size(), by.c_str());
  if (gridded > 0) std::printf(", %d cut in tile grids for the layouts served", gridded);
  std::printf("\n");
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// What every coordinator address answers of the replication (an address
// that does not answer: role unspecified, its error as the etcd error is not
// known). Empty for one coordinator without replicas.
std::vector<v1::ReplicaResponse> AskReplicas(const Connection& c) {
  Connection one = c;
  std::vector<v1::ReplicaResponse> out;
  bool replicated = false;
  for (const std::string& address : SplitList(CoordinatorAddress(c))) {
    one.coordinator = address;
    v1::ReplicaResponse r;
    auto client = Connect(one);
    auto answer = client.ok() ? (*client)->DescribeReplica() : StatusOr<v1::ReplicaResponse>(client.status());
    if (answer.ok()) {
      r = *answer;
    } else {
      r.set_etcd_error("this replica does not answer: " + answer.status().ToString());
    }
    r.set_address(address);
    replicated |= r.role() != v1::ReplicaResponse::SINGLE;
    out.push_back(std::move(r));
  }
  if (!replicated) out.clear();
  return out;
}

void PrintReplicas(const std::vector<v1::ReplicaResponse>& replicas) {
  std::string leader;
  for (const auto& r : replicas) {
    if (r.role() == v1::ReplicaResponse::LEADER) leader = r.address();
  }
  std::printf("coordinator replicas over etcd: %s\n",
              leader.empty() ? "no leader" : ("leader " + leader).c_str());
  std::printf("  %-40s %-9s %s\n", "REPLICA", "ROLE", "ETCD");
  for (const auto& r : replicas) {
    const char* role = r.role() == v1::ReplicaResponse::LEADER     ? "leader"
                       : r.role() == v1::ReplicaResponse::FOLLOWER ? "follower"
                                                                   : "-";
    std::string etcd;
    if (r.role() == v1::ReplicaResponse::ROLE_UNSPECIFIED) {
      etcd = r.etcd_error();
    } else if (r.etcd_failing_ms() == 0) {
      etcd = "answers" + (r.etcd_writes() ? " (" + std::to_string(r.etcd_writes()) + " writes as leader)" : "");
    } else {
      char since[96];
      std::snprintf(since, sizeof since, "failing for %.1f s (calls refused with ETCD_UNREACHABLE after %.1f s): ",
                    r.etcd_failing_ms() / 1000.0, r.unreachable_after_ms() / 1000.0);
      etcd = since + r.etcd_error();
    }
    std::printf("  %-40s %-9s %s\n", r.address().c_str(), role, etcd.c_str());
  }
}

Status RunStatus(const Connection& c) {
  const std::vector<v1::ReplicaResponse> replicas = AskReplicas(c);
  WSYNC_ASSIGN_OR_RETURN(auto client, Connect(c));
  auto status = client->GetStatus();
  if (!status.ok()) {
    // Without a leader the replicas' view is what explains why.
    if (!replicas.empty() && c.json) {
      v1::StatusResponse only;
      for (const auto& r : replicas) *only.add_replicas() = r;
      PrintJson(only);
    } else if (!replicas.empty()) {
      PrintReplicas(replicas);
    }
    return status.status();
  }
  v1::StatusResponse& s = *status;
  for (const auto& r : replicas) *s.add_replicas() = r;
  if (c.json) {
    PrintJson(s);
    return Status::Ok();
  }
  if (!replicas.empty()) {
    PrintReplicas(replicas);
    std::printf("\n");
  }
  std::printf("head version %" PRIu64 ", max staleness %s (%s), oldest needed version %" PRIu64 "\n",
              s.head_version(), s.max_staleness() ? std::to_string(s.max_staleness()).c_str() : "unbounded",
              s.policy() == v1::STALENESS_EVICT ? "evict" : "block", s.oldest_needed_version());
  if (auto l = client->GetLayout(); l.ok()) PrintLayout(*l);
  std::printf("\n");
  PrintNodes(s);
  if (s.leases_size() > 0) {
    std::printf("\n");
    PrintLeases(s.leases(), s.now_unix_ms());
  }
  if (auto v = client->ListVersions(s.head_version()); v.ok() && v->partial_size() > 0) {
    std::printf("\n");
    PrintPartial(*v);
  }
  return Status::Ok();
}

Status RunNodes(const Connection& c) {
  WSYNC_ASSIGN_OR_RETURN(auto client, Connect(c));
  WSYNC_ASSIGN_OR_RETURN(auto s, client->GetStatus());
  if (c.json) {
    v1::StatusResponse only;
    *only.mutable_nodes() = s.nodes();
    only.set_now_unix_ms(s.now_unix_ms());
    PrintJson(only);
    return Status::Ok();
  }
  PrintNodes(s);
  return Status::Ok();
}

Status RunVersions(const Connection& c, uint64_t after) {
  WSYNC_ASSIGN_OR_RETURN(auto client, Connect(c));
  WSYNC_ASSIGN_OR_RETURN(auto v, client->ListVersions(after));
  if (c.json) {
    PrintJson(v);
    return Status::Ok();
  }
  std::printf("%8s %8s %-8s %14s %14s %8s %-18s %-16s\n", "VERSION", "BASE", "KIND", "PATCH BYTES", "DENSE BYTES",
              "RATIO", "CHECKSUM", "SOURCE");
  for (const auto& s : v.versions()) {
    std::printf("%8" PRIu64 " %8" PRIu64 " %-8s %14" PRIu64 " %14" PRIu64 " %7.1fx %016" PRIx64 "   %-16s\n",
                s.version(), s.base_version(), s.incomplete() ? "encoding" : s.keyframe() ? "keyframe" : "patch", s.patch_bytes(), s.dense_bytes(),
                s.patch_bytes() ? static_cast<double>(s.dense_bytes()) / s.patch_bytes() : 0.0, s.set_checksum(),
                s.source().c_str());
  }
  PrintPartial(v);
  return Status::Ok();
}

Status RunLeases(const Connection& c) {
  WSYNC_ASSIGN_OR_RETURN(auto client, Connect(c));
  WSYNC_ASSIGN_OR_RETURN(auto l, client->ListLeases());
  if (c.json) {
    PrintJson(l);
    return Status::Ok();
  }
  std::printf("oldest leased version: %" PRIu64 "\n", l.oldest_leased_version());
  PrintLeases(l.leases(), NowMs());
  return Status::Ok();
}

}  // namespace

void AddControlCommands(CLI::App& app, std::function<Status()>* run) {
  auto conn = std::make_shared<Connection>();
  auto after = std::make_shared<uint64_t>(0);
  auto* status = app.add_subcommand("status", "nodes, roles, applied versions, staleness, leases");
  AddConnectionFlags(status, conn.get());
  status->callback([=] { *run = [=] { return RunStatus(*conn); }; });
  auto* nodes = app.add_subcommand("nodes", "registered nodes");
  AddConnectionFlags(nodes, conn.get());
  nodes->callback([=] { *run = [=] { return RunNodes(*conn); }; });
  auto* versions = app.add_subcommand("versions", "published versions");
  AddConnectionFlags(versions, conn.get());
  versions->add_option("--after", *after, "only versions above this");
  versions->callback([=] { *run = [=] { return RunVersions(*conn, *after); }; });
  auto* leases = app.add_subcommand("leases", "held leases");
  AddConnectionFlags(leases, conn.get());
  leases->callback([=] { *run = [=] { return RunLeases(*conn); }; });
}

}  // namespace wsync::cli

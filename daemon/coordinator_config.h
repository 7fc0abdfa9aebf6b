// Configuration of `wsyncd coordinator`: defaults, then the TOML file, then
// the environment, then flags. Validated once at start; every error names
// the key and what is wrong with it.
#pragma once

#include "store_follower.h"
#include <string>
#include <vector>

#include "wsync/control/coordinator_state.h"
#include "wsync/control/replica.h"
#include "wsync/control/server.h"
#include "wsync/util/status.h"

namespace wsync::daemon {

struct CoordinatorConfig {
  control::CoordinatorOptions state;
  control::ServerOptions server;
  std::string store_dir;   // empty: in memory only
  bool salvage_store = false;  // start from what verifies (control::StoreOptions::salvage)
  std::string token_file;  // read into server.token
  // Replicas over etcd: set by --etcd (replica.etcd_endpoints non-empty);
  // store_dir then unused.
  control::ReplicaOptions replica;
  std::string etcd_password_file;  // read into replica.etcd_password
  // A region's coordinator: announces the versions of a run in an object
  // store (url empty: none; not with replicas).
  StoreFollowOptions follow_store;
};


// Merges the [coordinator] table of a TOML file into *config. Unknown keys,
// wrong types and invalid values are InvalidArgument naming file and key.
Status LoadCoordinatorToml(const std::string& path, CoordinatorConfig* config);

// Parses "block" / "evict".
StatusOr<wsync::v1::StalenessPolicy> ParsePolicy(const std::string& name);

// Final checks after all sources are merged (listen addresses, TLS files
// come in pairs, TTLs); reads the token file.
Status FinishCoordinatorConfig(CoordinatorConfig* config);

}  // namespace wsync::daemon

#include "coordinator_config.h"

#include <set>

#include <toml++/toml.h>

namespace wsync::daemon {
namespace {

Status Bad(const std::string& path, const std::string& key, const std::string& why) {
  return InvalidArgumentError(path + ": coordinator." + key + ": " + why);
}

template <typename T>
Status GetInt(const toml::table& t, const std::string& path, const char* key, T* out, int64_t min, int64_t max) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return Status::Ok();
  auto v = n->value<int64_t>();
  if (!n->is_integer() || !v) return Bad(path, key, "must be an integer");
  if (*v < min || *v > max) {
    return Bad(path, key, "value " + std::to_string(*v) + " outside [" + std::to_string(min) + ", " +
                              std::to_string(max) + "]");
  }
  *out = static_cast<T>(*v);
  return Status::Ok();
}

Status GetString(const toml::table& t, const std::string& path, const char* key, std::string* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return Status::Ok();
  if (!n->is_string()) return Bad(path, key, "must be a string");
  *out = *n->value<std::string>();
  return Status::Ok();
}

Status GetBool(const toml::table& t, const std::string& path, const char* key, bool* out) {
  const toml::node* n = t.get(key);
  if (n == nullptr) return Status::Ok();
  if (!n->is_boolean()) return Bad(path, key, "must be true or false");
  *out = *n->value<bool>();
  return Status::Ok();
}

}  // namespace

StatusOr<wsync::v1::StalenessPolicy> ParsePolicy(const std::string& name) {
  if (name == "block") return wsync::v1::STALENESS_BLOCK;
  if (name == "evict") return wsync::v1::STALENESS_EVICT;
  return InvalidArgumentError("staleness policy '" + name + "' is not 'block' or 'evict'");
}

Status LoadCoordinatorToml(const std::string& path, CoordinatorConfig* config) {
  toml::table root;
  try {
    root = toml::parse_file(path);  // toml++ reports errors by exception: caught here, at the edge
  } catch (const toml::parse_error& err) {
    return InvalidArgumentError(path + ":" + std::to_string(err.source().begin.line) + ": " +
                                std::string(err.description()));
  }
  for (const auto& [key, node] : root) {
    if (key.str() != "coordinator") {
      return InvalidArgumentError(path + ": unknown table '" + std::string(key.str()) + "' (expected [coordinator])");
    }
  }
  const toml::table* t = root["coordinator"].as_table();
  if (t == nullptr) return Status::Ok();
  static const std::set<std::string> kKeys = {"listen", "store_dir", "token_file", "max_staleness",
                                              "staleness_policy", "fanout", "node_ttl_ms", "max_ttl_ms",
                                              "heartbeat_reports_from", "heartbeat_budget", "metrics_listen",
                                              "metrics_auth", "reflection", "tls", "etcd"};
  for (const auto& [key, node] : *t) {
    if (!kKeys.count(std::string(key.str()))) return Bad(path, std::string(key.str()), "unknown key");
  }
  if (const toml::node* n = t->get("listen")) {
    const toml::array* a = n->as_array();
    if (a == nullptr) return Bad(path, "listen", "must be an array of strings");
    config->server.listen.clear();
    for (const auto& e : *a) {
      if (!e.is_string()) return Bad(path, "listen", "must be an array of strings");
      config->server.listen.push_back(*e.value<std::string>());
    }
  }
  WSYNC_RETURN_IF_ERROR(GetString(*t, path, "store_dir", &config->store_dir));
  WSYNC_RETURN_IF_ERROR(GetString(*t, path, "token_file", &config->token_file));
  WSYNC_RETURN_IF_ERROR(GetString(*t, path, "metrics_listen", &config->server.metrics_listen));
  WSYNC_RETURN_IF_ERROR(GetBool(*t, path, "metrics_auth", &config->server.metrics_auth));
  WSYNC_RETURN_IF_ERROR(GetBool(*t, path, "reflection", &config->server.reflection));
  WSYNC_RETURN_IF_ERROR(GetInt(*t, path, "max_staleness", &config->state.max_staleness, 0, 1'000'000'000));
  WSYNC_RETURN_IF_ERROR(GetInt(*t, path, "fanout", &config->state.fanout, 1, 1024));
  WSYNC_RETURN_IF_ERROR(GetInt(*t, path, "node_ttl_ms", &config->state.default_ttl_ms, 100, 86'400'000));
  WSYNC_RETURN_IF_ERROR(GetInt(*t, path, "max_ttl_ms", &config->state.max_ttl_ms, 100, 86'400'000));
  WSYNC_RETURN_IF_ERROR(
      GetInt(*t, path, "heartbeat_reports_from", &config->state.heartbeat_reports_from, 0, 1'000'000'000));
  WSYNC_RETURN_IF_ERROR(GetInt(*t, path, "heartbeat_budget", &config->state.heartbeat_budget, 0, 1'000'000'000));
  std::string policy;
  WSYNC_RETURN_IF_ERROR(GetString(*t, path, "staleness_policy", &policy));
  if (!policy.empty()) {
    auto p = ParsePolicy(policy);
    if (!p.ok()) return Bad(path, "staleness_policy", p.status().message());
    config->state.policy = *p;
  }
  if (const toml::node* n = t->get("tls")) {
    const toml::table* tls = n->as_table();
    if (tls == nullptr) return Bad(path, "tls", "must be a table");
    for (const auto& [key, node] : *tls) {
      const std::string k(key.str());
      if (k != "cert" && k != "key" && k != "client_ca") return Bad(path, "tls." + k, "unknown key");
      if (!node.is_string()) return Bad(path, "tls." + k, "must be a string");
    }
    WSYNC_RETURN_IF_ERROR(GetString(*tls, path, "cert", &config->server.tls.cert_file));
    WSYNC_RETURN_IF_ERROR(GetString(*tls, path, "key", &config->server.tls.key_file));
    WSYNC_RETURN_IF_ERROR(GetString(*tls, path, "client_ca", &config->server.tls.client_ca_file));
  }
  if (const toml::node* n = t->get("etcd")) {
    const toml::table* etcd = n->as_table();
    if (etcd == nullptr) return Bad(path, "etcd", "must be a table");
    static const std::set<std::string> kEtcdKeys = {"endpoints", "prefix", "advertise", "lease_ttl_s", "ca",
                                                    "cert", "key", "user", "password_file"};
    for (const auto& [key, node] : *etcd) {
      if (!kEtcdKeys.count(std::string(key.str()))) return Bad(path, "etcd." + std::string(key.str()), "unknown key");
    }
    auto& r = config->replica;
    if (const toml::node* e = etcd->get("endpoints")) {
      const toml::array* a = e->as_array();
      if (a == nullptr) return Bad(path, "etcd.endpoints", "must be an array of strings");
      r.etcd_endpoints.clear();
      for (const auto& x : *a) {
        if (!x.is_string()) return Bad(path, "etcd.endpoints", "must be an array of strings");
        r.etcd_endpoints.push_back(*x.value<std::string>());
      }
    }
    WSYNC_RETURN_IF_ERROR(GetString(*etcd, path, "prefix", &r.prefix));
    WSYNC_RETURN_IF_ERROR(GetString(*etcd, path, "advertise", &r.advertise));
    WSYNC_RETURN_IF_ERROR(GetInt(*etcd, path, "lease_ttl_s", &r.lease_ttl_s, 1, 3600));
    WSYNC_RETURN_IF_ERROR(GetString(*etcd, path, "ca", &r.etcd_ca_file));
    WSYNC_RETURN_IF_ERROR(GetString(*etcd, path, "cert", &r.etcd_cert_file));
    WSYNC_RETURN_IF_ERROR(GetString(*etcd, path, "key", &r.etcd_key_file));
    WSYNC_RETURN_IF_ERROR(GetString(*etcd, path, "user", &r.etcd_user));
    WSYNC_RETURN_IF_ERROR(GetString(*etcd, path, "password_file", &config->etcd_password_file));
  }
  return Status::Ok();
}

Status FinishCoordinatorConfig(CoordinatorConfig* config) {
  if (config->server.listen.empty()) return InvalidArgumentError("no listen address: give --listen host:port or unix:PATH");
  for (const auto& a : config->server.listen) {
    const bool unix_socket = a.rfind("unix:", 0) == 0;
    if (unix_socket ? a.size() <= 5 : a.rfind(':') == std::string::npos) {
      return InvalidArgumentError("listen address '" + a + "' is not host:port or unix:PATH");
    }
  }
  if (const auto& follow = config->follow_store; !follow.url.empty()) {
    if (!config->replica.etcd_endpoints.empty()) {
      return InvalidArgumentError("--follow-store runs on one coordinator, not on replicas over etcd (--etcd)");
    }
    if (follow.run.empty()) return InvalidArgumentError("--follow-store needs --store-run (the run's key prefix)");
    WSYNC_RETURN_IF_ERROR(store::S3OptionsFromUrl(follow.url).status().WithContext("--follow-store"));
  }
  const auto& tls = config->server.tls;
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return InvalidArgumentError("TLS needs both a certificate and a key");
  }
  if (!tls.client_ca_file.empty() && tls.cert_file.empty()) {
    return InvalidArgumentError("a client CA (mTLS) needs a server certificate and key");
  }
  if (config->state.default_ttl_ms > config->state.max_ttl_ms) {
    return InvalidArgumentError("node_ttl_ms exceeds max_ttl_ms");
  }
  if (!config->token_file.empty()) {
    WSYNC_ASSIGN_OR_RETURN(config->server.token, control::ReadTokenFile(config->token_file));
  }
  auto& r = config->replica;
  if (!r.etcd_endpoints.empty()) {
    if (!config->store_dir.empty()) {
      return InvalidArgumentError("--store-dir and --etcd exclude each other: the replicas' state is etcd's");
    }
    if (r.advertise.empty()) {
      return InvalidArgumentError("a coordinator replica (--etcd) needs --advertise host:port: the address the "
                                  "other replicas send clients to");
    }
    if (r.etcd_cert_file.empty() != r.etcd_key_file.empty()) {
      return InvalidArgumentError("etcd TLS: --etcd-cert and --etcd-key go together");
    }
    if (!config->etcd_password_file.empty()) {
      if (r.etcd_user.empty()) return InvalidArgumentError("--etcd-password-file needs --etcd-user");
      WSYNC_ASSIGN_OR_RETURN(r.etcd_password, control::ReadTokenFile(config->etcd_password_file));
    }
    r.coordinator = config->state;
  }
  return Status::Ok();
}

}  // namespace wsync::daemon

#include "channel.h"

#include "wsync/util/file.h"

namespace wsync::control {

StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientCredentials(const std::string& ca_file,
                                                                      const std::string& cert_file,
                                                                      const std::string& key_file) {
  if (ca_file.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  WSYNC_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(ca_file));
  if (!cert_file.empty()) {
    WSYNC_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFile(cert_file));
    WSYNC_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFile(key_file));
  }
  return grpc::SslCredentials(ssl);
}

void ReconnectQuickly(grpc::ChannelArguments* args, int max_backoff_ms) {
  args->SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args->SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args->SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, max_backoff_ms);
}

}  // namespace wsync::control

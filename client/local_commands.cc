#include "local_commands.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "json_output.h"
#include "wsync/buffers/descriptor_inbox.h"
#include "wsync/buffers/region.h"
#include "wsync/buffers/safetensors.h"
#include "wsync/cuda/device_codec.h"
#include "wsync/control/rpc_status.h"
#include "wsync/cuda/ipc.h"
#include "wsync/v1/local.grpc.pb.h"

namespace wsync::cli {
namespace {

namespace v1 = wsync::v1;

using control::FromGrpc;

std::unique_ptr<v1::Local::Stub> Connect(std::string local) {
  if (local.rfind("unix:", 0) != 0) local = "unix:" + local;
  return v1::Local::NewStub(grpc::CreateChannel(local, grpc::InsecureChannelCredentials()));
}

void Deadline(grpc::ClientContext* ctx, int64_t ms) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
}

// The memory a stand-in trainer or inference server shares with its daemon:
// a memfd passed over the daemon's memory socket (or POSIX shared memory of
// a name given), or (device >= 0) one device allocation exported over CUDA
// IPC, as a PyTorch caching-allocator segment would be.
struct LocalBuffers {
  std::unique_ptr<buffers::Region> shm;
  buffers::OwnedFd memfd;  // open for as long as the memory is served: a restarted daemon is given it again
  cuda::DeviceBuffer device;
};

// Before each RegisterTensors: the memfd goes to the daemon's memory socket
// under a new token, which the request's region then names.
Status PassMemory(const std::string& local, const LocalBuffers& b, v1::RegisterTensorsRequest* req) {
  if (b.memfd.get() < 0) return Status::Ok();
  const std::string path = (local.rfind("unix:", 0) == 0 ? local.substr(5) : local) + ".fds";
  const std::string token = buffers::NewDescriptorToken();
  WSYNC_RETURN_IF_ERROR(buffers::PassDescriptors(path, token, {b.memfd.get()}, std::chrono::seconds(30)));
  req->mutable_regions(0)->set_fd_token(token);
  return Status::Ok();
}

// Memory laid out like `tensors` (256-byte aligned), its table in *req, and
// (copy) the tensors' bytes in it.
StatusOr<LocalBuffers> MakeBuffers(const std::string& shm, int device, const std::vector<codec::TensorView>& tensors,
                                   v1::RegisterTensorsRequest* req, bool copy) {
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    auto* spec = req->add_tensors();
    spec->set_name(t.name);
    spec->set_dtype(std::string(codec::DTypeName(t.dtype)));
    for (uint64_t d : t.shape) spec->add_shape(d);
    spec->set_offset(offset);
    offset += (t.NumBytes() + 255) / 256 * 256;
  }
  const uint64_t size = std::max<uint64_t>(offset, 256);
  LocalBuffers b;
  if (device < 0) {
    if (shm.empty()) {
      WSYNC_ASSIGN_OR_RETURN(auto m, buffers::CreateMemoryFile(size, "wsync-buffers"));
      b.memfd = std::move(m.fd);
      b.shm = std::move(m.region);
      req->add_regions();  // its fd_token is set as the memory is passed (PassMemory)
    } else {
      WSYNC_ASSIGN_OR_RETURN(b.shm, buffers::CreateShm(shm, size, /*unlink_on_close=*/true));
      req->set_shm_name(shm);
    }
    for (int i = 0; copy && i < req->tensors_size(); ++i) {
      std::memcpy(b.shm->data() + req->tensors(i).offset(), tensors[i].data, tensors[i].NumBytes());
    }
    return b;
  }
  WSYNC_ASSIGN_OR_RETURN(b.device, cuda::DeviceBuffer::Allocate(size, device));
  for (int i = 0; copy && i < req->tensors_size(); ++i) {
    WSYNC_RETURN_IF_ERROR(b.device.CopyFromHost(tensors[i].data, tensors[i].NumBytes(), req->tensors(i).offset()));
  }
  WSYNC_ASSIGN_OR_RETURN(cuda::IpcHandle h, cuda::ExportDeviceMemory(b.device.data(), size));
  req->set_cuda_ipc_handle(h.ToString());
  return b;
}

}  // namespace

Status PublishFile(const std::string& local, const std::string& file, uint64_t version, int64_t wait_ms, int device,
                   bool after_copy) {
  WSYNC_ASSIGN_OR_RETURN(auto st, buffers::SafetensorsFile::Open(file));
  v1::RegisterTensorsRequest reg;
  WSYNC_ASSIGN_OR_RETURN(auto region, MakeBuffers("", device, st->tensors(), &reg, /*copy=*/true));
  auto stub = Connect(local);
  {
    WSYNC_RETURN_IF_ERROR(PassMemory(local, region, &reg));
    grpc::ClientContext ctx;
    Deadline(&ctx, 30'000);
    v1::RegisterTensorsResponse resp;
    WSYNC_RETURN_IF_ERROR(FromGrpc(stub->RegisterTensors(&ctx, reg, &resp), "register with " + local));
  }
  grpc::ClientContext ctx;
  Deadline(&ctx, 60'000 + wait_ms);
  v1::LocalPublishRequest req;
  req.set_version(version);
  req.set_wait_ms(wait_ms);
  req.set_return_after_copy(after_copy);
  v1::LocalPublishResponse resp;
  WSYNC_RETURN_IF_ERROR(FromGrpc(stub->Publish(&ctx, req, &resp), "publish"));
  if (resp.pending()) {
    std::printf("version %" PRIu64 " copied: %" PRIu64 " dense bytes in %.1f ms; encoded and announced in the background\n",
                resp.version(), resp.dense_bytes(), resp.copy_ms());
    return Status::Ok();
  }
  std::printf("version %" PRIu64 " published: %" PRIu64 " bytes for %" PRIu64 " dense (%.1fx), encoded in %.1f ms\n",
              resp.version(), resp.patch_bytes(), resp.dense_bytes(),
              resp.patch_bytes() ? static_cast<double>(resp.dense_bytes()) / resp.patch_bytes() : 0.0,
              resp.encode_ms());
  return Status::Ok();
}

namespace {

Status RunDump(const std::string& local, const std::string& out, uint64_t version, int64_t timeout_ms) {
  auto stub = Connect(local);
  grpc::ClientContext ctx;
  Deadline(&ctx, timeout_ms + 30'000);
  v1::DumpRequest req;
  req.set_path(std::filesystem::absolute(out).string());
  req.set_version(version);
  req.set_timeout_ms(timeout_ms);
  v1::DumpResponse resp;
  WSYNC_RETURN_IF_ERROR(FromGrpc(stub->Dump(&ctx, req, &resp), "dump from " + local));
  std::printf("%s: version %" PRIu64 "\n", out.c_str(), resp.version());
  return Status::Ok();
}

Status RunServeBuffers(const std::string& local, const std::string& like, const std::string& shm_name, int device) {
  WSYNC_ASSIGN_OR_RETURN(auto st, buffers::SafetensorsFile::Open(like));
  v1::RegisterTensorsRequest reg;
  WSYNC_ASSIGN_OR_RETURN(auto region, MakeBuffers(shm_name, device, st->tensors(), &reg, /*copy=*/false));
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  auto stub = Connect(local);
  auto do_register = [&](uint64_t applied) {
    WSYNC_RETURN_IF_ERROR(PassMemory(local, region, &reg));
    grpc::ClientContext ctx;
    Deadline(&ctx, 30'000);
    ctx.set_wait_for_ready(true);
    reg.set_applied_version(applied);
    v1::RegisterTensorsResponse resp;
    return FromGrpc(stub->RegisterTensors(&ctx, reg, &resp), "register with " + local);
  };
  WSYNC_RETURN_IF_ERROR(do_register(0));
  const std::string where = device >= 0          ? "device " + std::to_string(device)
                            : shm_name.empty() ? std::string("a memfd")
                                               : shm_name;
  std::printf("serving %d tensors in %s to %s; stop with SIGTERM\n", reg.tensors_size(), where.c_str(), local.c_str());
  std::fflush(stdout);
  // Like an inference server: when the sink daemon restarts, register the
  // same memory again, saying which version it holds.
  uint64_t held = 0;
  bool sink_down = false;
  const timespec tick{0, 200'000'000};
  for (;;) {
    int sig = sigtimedwait(&stop, nullptr, &tick);
    if (sig > 0) return Status::Ok();
    grpc::ClientContext ctx;
    Deadline(&ctx, 1000);
    v1::LocalStatusResponse st;
    grpc::Status s = stub->Status(&ctx, v1::LocalStatusRequest(), &st);
    if (!s.ok()) {
      sink_down = true;
      continue;
    }
    if (sink_down || st.tensors() == 0) {  // a new sink process knows no tensors
      sink_down = false;
      Status r = do_register(held);
      std::fprintf(stderr, "sink restarted: registered again holding version %" PRIu64 ": %s\n", held,
                   r.ToString().c_str());
      continue;
    }
    held = st.version();
  }
}

Status RunLocalStatus(const std::string& local, bool json) {
  auto stub = Connect(local);
  grpc::ClientContext ctx;
  Deadline(&ctx, 5000);
  v1::LocalStatusResponse st;
  WSYNC_RETURN_IF_ERROR(FromGrpc(stub->Status(&ctx, v1::LocalStatusRequest(), &st), "status of " + local));
  if (json) {
    PrintJson(st);
    return Status::Ok();
  }
  std::printf("%s %s: version %" PRIu64 ", %" PRIu64 " tensors, %" PRIu64 " bytes served\n", st.role().c_str(),
              st.name().c_str(), st.version(), st.tensors(), st.bytes_served());
  if (st.role() == "sink") {
    std::printf("%" PRIu64 " pulls made, %" PRIu64 " bytes received\n", st.pulls_made(), st.bytes_received());
    if (st.apply_ms() > 0) {
      std::printf("last version: staged in %.1f ms while the weights were read, applied in %.1f ms between the holds\n",
                  st.staging_ms(), st.apply_ms());
    }
    if (st.staged_version() > 0) {
      std::printf("version %" PRIu64 " staged, waiting for the holds to end\n", st.staged_version());
    }
    if (st.foreign_writes() > 0) {
      std::printf("FOREIGN WRITES: %" PRIu64 " time(s) another writer changed the weights while a version was applied "
                  "(see the daemon's log)\n",
                  st.foreign_writes());
    }
  }
  if (st.active_holds() > 0) {
    std::printf("%u hold(s) active, the oldest for %.1f s\n", st.active_holds(), st.oldest_hold_ms() / 1000.0);
  }
  if (!st.sync_error().empty()) {
    std::printf("cannot sync (%" PRIu64 " failed attempts): %s\n", st.sync_failures(), st.sync_error().c_str());
  }
  return Status::Ok();
}

}  // namespace

void AddLocalCommands(CLI::App& app, std::function<Status()>* run) {
  {
    auto* cmd = app.add_subcommand("publish", "publish a safetensors checkpoint through a source daemon");
    auto local = std::make_shared<std::string>(), file = std::make_shared<std::string>();
    auto version = std::make_shared<uint64_t>(0);
    auto wait = std::make_shared<int64_t>(0);
    cmd->add_option("--local", *local, "the source's unix:PATH")->required();
    cmd->add_option("FILE", *file, "safetensors checkpoint")->required()->check(CLI::ExistingFile);
    cmd->add_option("--version", *version, "version (the trainer step; grows)")->required();
    cmd->add_option("--wait-ms", *wait, "wait this long for lagging sinks (staleness bound)");
    auto device = std::make_shared<int>(-1);
    cmd->add_option("--device", *device, "put the weights in this GPU's memory (CUDA IPC) instead of shared memory");
    auto after_copy = std::make_shared<bool>(false);
    cmd->add_flag("--after-copy", *after_copy,
                  "return once the source has copied the weights (host regions); it encodes and announces the "
                  "version in the background, and the next publish reports a failure");
    cmd->callback([=] { *run = [=] { return PublishFile(*local, *file, *version, *wait, *device, *after_copy); }; });
  }
  {
    auto* cmd = app.add_subcommand("local-status", "a local daemon's role, version and bytes served");
    auto local = std::make_shared<std::string>();
    cmd->add_option("--local", *local, "the daemon's unix:PATH")->required();
    auto json = std::make_shared<bool>(false);
    cmd->add_flag("--json", *json, "every field of the daemon's status as JSON");
    cmd->callback([=] { *run = [=] { return RunLocalStatus(*local, *json); }; });
  }
  {
    auto* cmd = app.add_subcommand("dump", "write a sink's current weights to a safetensors file");
    auto local = std::make_shared<std::string>(), out = std::make_shared<std::string>();
    auto version = std::make_shared<uint64_t>(0);
    auto timeout = std::make_shared<int64_t>(60'000);
    cmd->add_option("--local", *local, "the sink's unix:PATH")->required();
    cmd->add_option("-o,--output", *out, "safetensors file to write")->required();
    cmd->add_option("--version", *version, "wait until at least this version is applied");
    cmd->add_option("--timeout-ms", *timeout, "how long to wait for it")->capture_default_str();
    cmd->callback([=] { *run = [=] { return RunDump(*local, *out, *version, *timeout); }; });
  }
  {
    auto* cmd = app.add_subcommand("serve-buffers",
                                   "own shared memory shaped like FILE for a sink (a stand-in inference server)");
    auto local = std::make_shared<std::string>(), like = std::make_shared<std::string>(),
         shm = std::make_shared<std::string>();
    cmd->add_option("--local", *local, "the sink's unix:PATH")->required();
    cmd->add_option("--like", *like, "safetensors file giving names, dtypes and shapes")->required()
        ->check(CLI::ExistingFile);
    cmd->add_option("--shm", *shm, "POSIX shared memory of this name (default: a memfd passed to the sink, no name)");
    auto device = std::make_shared<int>(-1);
    cmd->add_option("--device", *device, "own this GPU's memory (CUDA IPC) instead of shared memory");
    cmd->callback([=] { *run = [=] { return RunServeBuffers(*local, *like, *shm, *device); }; });
  }
}

}  // namespace wsync::cli

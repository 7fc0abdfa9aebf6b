// wsync: the command-line client.
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <functional>

#include "codec_commands.h"
#include "control_commands.h"
#include "local_commands.h"
#include "store_commands.h"

int main(int argc, char** argv) {
  CLI::App app{"wsync: lossless sparse weight sync for RL training (see README.md)"};
  app.require_subcommand(1);
  std::function<wsync::Status()> run;
  wsync::cli::AddCodecCommands(app, &run);
  wsync::cli::AddControlCommands(app, &run);
  wsync::cli::AddLocalCommands(app, &run);
  wsync::cli::AddStoreCommands(app, &run);
  CLI11_PARSE(app, argc, argv);
  // Warnings go to stderr: stdout carries results (--json: a JSON document).
  spdlog::set_default_logger(spdlog::stderr_color_mt("wsync"));
  spdlog::set_level(spdlog::level::warn);
  wsync::Status status = run ? run() : wsync::InternalError("no command");
  if (!status.ok()) {
    std::fprintf(stderr, "wsync: error: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

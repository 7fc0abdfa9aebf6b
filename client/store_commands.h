// The object-store subcommands of `wsync` (docs/object-store.md): `store
// pull`, a puller with read access to the store only (no daemon, no
// coordinator), keeping a safetensors file at the newest version; `store
// ls`, the versions a run holds.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

#include "wsync/util/status.h"

namespace wsync::cli {

void AddStoreCommands(CLI::App& app, std::function<Status()>* run);

}  // namespace wsync::cli

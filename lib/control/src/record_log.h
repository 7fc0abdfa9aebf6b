// How the coordinator's components make a mutation durable (internal to
// wsync::control).
#pragma once

#include <functional>

#include "wsync/util/status.h"
#include "wsync/v1/store.pb.h"

namespace wsync::control {

// `log(record)` appends `record` to the coordinator's Store and applies it
// to every component, the caller's included, before it returns Ok; when it
// returns an error nothing was applied. A component's method that logs
// reads the record's effect from its own state after the call.
using RecordLog = std::function<Status(const wsync::store::v1::Record&)>;

}  // namespace wsync::control

// Fault injection for the coordinator's tests (internal to wsync::control):
// a call that carries the metadata kDieAfterCommit, to a coordinator
// started with ServerOptions::inject_faults, kills its process right after
// its first durable write commits, before any answer: the answer is lost
// and the write is not.
#pragma once

namespace wsync::control::fault {

inline constexpr char kMetadataKey[] = "wsync-inject-fault";
inline constexpr char kDieAfterCommit[] = "die-after-commit";

// Set by the server for the call it handles on this thread.
inline thread_local bool die_after_commit = false;

}  // namespace wsync::control::fault

// Corrections applied to what xeus 2.4.1 sends, before the kernel re-signs it for the client. Each one
// works around a verified xeus 2.4.1 deviation from the Jupyter messaging protocol 5.3.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace cellblock::kernel {

enum class WireChannel { shell, control, stdin_channel, iopub };

enum class Fixup {
    unchanged,  // forward the frames as they are
    modified,   // content was rewritten: serialize it again
    drop,       // not for clients (xeus's non-standard IOPub "interrupt")
};

// - input_request: xeus sends "pwd"; frontends read "password".
// - *_reply {"status":"error"} without ename: xeus's answer to requests aborted by stop_on_error;
//   the protocol (and ipykernel) says {"status":"aborted"}.
// - interrupt_reply: xeus sends {} without a status.
// - IOPub "interrupt": a xeus-only message; clients' schema validators reject it.
Fixup fix_outbound(WireChannel channel, std::string_view msg_type, nlohmann::json& content);

// execute_reply: the interpreter puts what happened (outcome, state_lost, output_truncated) in the
// content's "cellblock" member, because xeus 2.4.1 gives it no say over reply metadata; it belongs in
// metadata.cellblock. Returns true if content and metadata were changed (metadata that is not an object
// is replaced).
bool move_outcome_to_metadata(nlohmann::json& content, nlohmann::json& metadata);

// Every shell reply names, in metadata.cellblock.last_iopub_msg_id, the IOPub message the kernel published
// last before it. IOPub and shell are separate sockets, so a large output can reach a client after the reply
// sent after it; a client (the gateway) that holds the reply until that IOPub message has arrived sees the
// kernel's order (PROTOCOL.md, "Clients"). Metadata that is not an object is replaced.
void name_last_iopub_message(nlohmann::json& metadata, const std::string& msg_id);

}  // namespace cellblock::kernel

#include "server/protocol_fixups.hpp"

namespace cellblock::kernel {
namespace {

bool ends_with(std::string_view text, std::string_view suffix) {
    return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

}  // namespace

Fixup fix_outbound(WireChannel channel, std::string_view msg_type, nlohmann::json& content) {
    if (channel == WireChannel::iopub) {
        return msg_type == "interrupt" ? Fixup::drop : Fixup::unchanged;
    }
    if (!content.is_object()) {
        return Fixup::unchanged;
    }
    if (channel == WireChannel::stdin_channel && msg_type == "input_request") {
        if (!content.contains("pwd")) {
            return Fixup::unchanged;
        }
        content["password"] = content["pwd"].is_boolean() && content["pwd"].get<bool>();
        content.erase("pwd");
        return Fixup::modified;
    }
    if (msg_type == "interrupt_reply") {
        if (content.contains("status")) {
            return Fixup::unchanged;
        }
        content["status"] = "ok";
        return Fixup::modified;
    }
    if (ends_with(msg_type, "_reply")) {
        const auto status = content.find("status");
        if (status != content.end() && *status == "error" && !content.contains("ename")) {
            content = {{"status", "aborted"}};
            return Fixup::modified;
        }
    }
    return Fixup::unchanged;
}

bool move_outcome_to_metadata(nlohmann::json& content, nlohmann::json& metadata) {
    if (!content.is_object()) {
        return false;
    }
    const auto found = content.find("cellblock");
    if (found == content.end()) {
        return false;
    }
    if (!metadata.is_object()) {
        metadata = nlohmann::json::object();
    }
    metadata["cellblock"] = std::move(*found);
    content.erase("cellblock");
    return true;
}

void name_last_iopub_message(nlohmann::json& metadata, const std::string& msg_id) {
    if (!metadata.is_object()) {
        metadata = nlohmann::json::object();
    }
    nlohmann::json& ours = metadata["cellblock"];
    if (!ours.is_object()) {
        ours = nlohmann::json::object();
    }
    ours["last_iopub_msg_id"] = msg_id;
}

}  // namespace cellblock::kernel

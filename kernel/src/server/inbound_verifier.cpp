#include "server/inbound_verifier.hpp"

#include <optional>

namespace cellblock::kernel {
namespace {

constexpr std::string_view delimiter_frame = "<IDS|MSG>";

std::optional<std::size_t> find_delimiter(const std::vector<std::string_view>& frames) {
    for (std::size_t i = 0; i < frames.size(); ++i) {
        if (frames[i] == delimiter_frame) {
            return i;
        }
    }
    return std::nullopt;
}

}  // namespace

const char* describe(InboundVerdict::Kind kind) noexcept {
    switch (kind) {
        case InboundVerdict::Kind::accepted:
            return "accepted";
        case InboundVerdict::Kind::malformed:
            return "malformed";
        case InboundVerdict::Kind::bad_signature:
            return "bad_signature";
        case InboundVerdict::Kind::replayed:
            return "replayed";
        case InboundVerdict::Kind::bad_header:
            return "bad_header";
        case InboundVerdict::Kind::bad_json:
            return "bad_json";
    }
    return "?";
}

InboundVerdict InboundVerifier::check(const std::vector<std::string_view>& frames) {
    InboundVerdict verdict;
    const auto delimiter = find_delimiter(frames);
    // delimiter, signature, header, parent_header, metadata, content (+ optional buffers)
    if (!delimiter || frames.size() < *delimiter + 6) {
        verdict.kind = InboundVerdict::Kind::malformed;
        return verdict;
    }
    const std::size_t d = *delimiter;
    const std::string_view signature = frames[d + 1];
    const SignedParts parts = {frames[d + 2], frames[d + 3], frames[d + 4], frames[d + 5]};
    if (!signer_.verify(signature, parts)) {
        verdict.kind = InboundVerdict::Kind::bad_signature;
        return verdict;
    }
    // Without a key there is no signature to remember; replay protection needs signing.
    if (signer_.enabled() && !replays_.first_time(signature)) {
        verdict.kind = InboundVerdict::Kind::replayed;
        return verdict;
    }
    verdict.header = nlohmann::json::parse(frames[d + 2], nullptr, false);
    const auto msg_type = verdict.header.is_object() ? verdict.header.find("msg_type") : verdict.header.end();
    if (msg_type == verdict.header.end() || !msg_type->is_string()) {
        verdict.kind = InboundVerdict::Kind::bad_header;
        return verdict;
    }
    verdict.parent_header = nlohmann::json::parse(frames[d + 3], nullptr, false);
    verdict.metadata = nlohmann::json::parse(frames[d + 4], nullptr, false);
    verdict.content = nlohmann::json::parse(frames[d + 5], nullptr, false);
    if (verdict.parent_header.is_discarded() || verdict.metadata.is_discarded() ||
        verdict.content.is_discarded()) {
        verdict.kind = InboundVerdict::Kind::bad_json;
        return verdict;
    }
    verdict.kind = InboundVerdict::Kind::accepted;
    verdict.delimiter = d;
    verdict.msg_type = msg_type->get<std::string>();
    return verdict;
}

}  // namespace cellblock::kernel

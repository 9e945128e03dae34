// What the kernel serializes: every message it sends (kernel/src/common/json_text.cpp, dump_json), whose
// strings carry whatever the worker printed.
//
// Input: the bytes of a string value, or (first byte 0x7B, `{`) a JSON text.
// Invariant: dump_json is nlohmann::json's compact dump with invalid UTF-8 replaced, byte for byte, for the
// bytes as a string, as an object's key and nested in an object and an array; for JSON text that parses, for
// the parsed value.
#include "common/json_text.hpp"

#include <nlohmann/json.hpp>
#include <string>

#include "fuzz_support.hpp"

using cellblock::fuzz::require;
using cellblock::kernel::dump_json;
using nlohmann::json;

namespace {
void check(const json& value) {
    require(dump_json(value) == value.dump(-1, ' ', false, json::error_handler_t::replace),
            "dump_json differs from nlohmann's dump");
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string bytes(reinterpret_cast<const char*>(data), size);
    check(json(bytes));
    check(json(
        {{bytes, 1}, {"text", bytes}, {"nested", {{"data", json::array({bytes, bytes + bytes, nullptr})}}}}));
    if (!bytes.empty() && bytes.front() == '{') {
        const json parsed = json::parse(bytes, nullptr, false);
        if (!parsed.is_discarded()) {
            check(parsed);
        }
    }
    return 0;
}

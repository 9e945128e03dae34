// The kernel's one way to turn JSON into message text: nlohmann::json's compact dump with invalid UTF-8
// replaced by U+FFFD, byte for byte, at the cost of a copy for long text. nlohmann escapes a string one byte
// at a time through a UTF-8 decoder (about 3 ns a byte here): of a 1 MiB print's 5.3 ms of kernel CPU, 3 ms
// were that. Here every run of bytes that JSON writes as they are (ASCII from the space up, but `"` and `\`)
// is copied whole, and every other byte is still escaped by nlohmann, so what is valid JSON and how a control
// character, a quote or a broken sequence is written stays nlohmann's.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace cellblock::kernel {

// Equal to value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).
std::string dump_json(const nlohmann::json& value);

}  // namespace cellblock::kernel

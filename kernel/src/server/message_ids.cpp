#include "server/message_ids.hpp"

#include <openssl/rand.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>

#include "common/logging.hpp"

namespace cellblock::kernel {

std::array<unsigned char, 16> random_uuid() {
    std::array<unsigned char, 16> bytes{};
    if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1) {
        throw std::runtime_error("RAND_bytes failed: no random bytes for a message id");
    }
    bytes[6] = static_cast<unsigned char>((bytes[6] & 0x0f) | 0x40);  // version 4: random
    bytes[8] = static_cast<unsigned char>((bytes[8] & 0x3f) | 0x80);  // variant 1 (RFC 4122)
    return bytes;
}

}  // namespace cellblock::kernel

extern "C" void uuid_generate(unsigned char* out) {
    try {
        const auto id = cellblock::kernel::random_uuid();
        std::memcpy(out, id.data(), id.size());
    } catch (const std::exception& error) {
        cellblock::kernel::log_event(cellblock::kernel::LogLevel::error, "message_id_failed",
                                     {{"error", error.what()}});
        std::abort();
    }
}

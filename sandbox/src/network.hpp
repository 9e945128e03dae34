// Network: the sandbox gets an empty network namespace; only loopback is brought up.
#pragma once

namespace cellblock::sandbox::detail {

// Child side: ifup lo. Returns 0 or an errno.
int bring_loopback_up() noexcept;

}  // namespace cellblock::sandbox::detail

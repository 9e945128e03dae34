#pragma once

#include "cellblock/sandbox/unique_fd.hpp"

namespace cellblock::kernel {
using cellblock::sandbox::UniqueFd;
}  // namespace cellblock::kernel

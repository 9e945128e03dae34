#pragma once

#include "cellblock/sandbox/unique_fd.hpp"

namespace cellblock::sandbox::detail {
using cellblock::sandbox::UniqueFd;
}  // namespace cellblock::sandbox::detail

#include "runtime_dir.hpp"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <vector>

namespace cellblock::kernel {

PrivateDirectory::PrivateDirectory(const std::filesystem::path& parent, const std::string& prefix) {
    std::string pattern = (parent / (prefix + "XXXXXX")).string();
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    if (::mkdtemp(buffer.data()) == nullptr) {
        throw std::runtime_error("cannot create a private directory in " + parent.string() + ": " + std::strerror(errno));
    }
    path_ = buffer.data();
}

PrivateDirectory::~PrivateDirectory() { remove(); }

void PrivateDirectory::remove() noexcept {
    if (path_.empty()) return;
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
    path_.clear();
}

}  // namespace cellblock::kernel

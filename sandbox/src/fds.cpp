#include "fds.hpp"

#include <fcntl.h>
#include <linux/close_range.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace cellblock::sandbox::detail {

void plan_fds(std::vector<int> sources, StepNames& steps, ChildPlan& plan) {
    plan.fds.sources = std::move(sources);
    int highest = std::max({plan.sync_read_fd, plan.error_write_fd, 2});
    for (const int fd : plan.fds.sources) {
        highest = std::max(highest, fd);
    }
    highest = std::max(highest, static_cast<int>(plan.fds.sources.size()) + 1);
    plan.fds.dup_base = highest + 1;
    plan.fds.step_dup = steps.add("dup the program's fds into place");
    plan.fds.step_close = steps.add("close_range (close every other fd)");
}

bool install_fds(const ChildPlan& plan, int* failed_step, int* error_fd) noexcept {
    const auto& sources = plan.fds.sources;
    const int count = static_cast<int>(sources.size());
    // First copy every source above all of them, so that placing fd i never clobbers a source j > i.
    int scratch[512];
    if (count > 510) {
        errno = EMFILE;
        *failed_step = plan.fds.step_dup;
        return false;
    }
    for (int i = 0; i < count; ++i) {
        scratch[i] = ::fcntl(sources[static_cast<std::size_t>(i)], F_DUPFD_CLOEXEC, plan.fds.dup_base);
        if (scratch[i] < 0) {
            *failed_step = plan.fds.step_dup;
            return false;
        }
    }
    const int error_scratch = ::fcntl(plan.error_write_fd, F_DUPFD_CLOEXEC, plan.fds.dup_base);
    if (error_scratch < 0) {
        *failed_step = plan.fds.step_dup;
        return false;
    }
    for (int i = 0; i < count; ++i) {
        if (::dup2(scratch[i], i) < 0) {  // dup2 leaves the new fd without CLOEXEC: it survives execve
            *failed_step = plan.fds.step_dup;
            return false;
        }
    }
    // The error pipe sits right after the program's fds (CLOEXEC: it closes on execve, which is how the
    // parent learns of success); everything above it is closed now.
    if (::dup3(error_scratch, count, O_CLOEXEC) < 0) {
        *failed_step = plan.fds.step_dup;
        return false;
    }
    *error_fd = count;
    if (::syscall(SYS_close_range, static_cast<unsigned>(count + 1), ~0U, 0U) != 0) {
        *failed_step = plan.fds.step_close;
        return false;
    }
    return true;
}

std::vector<std::string> merge_environment(const std::vector<std::string>& base,
                                           const std::vector<std::string>& overrides) {
    std::vector<std::string> merged;
    auto name_of = [](const std::string& entry) { return entry.substr(0, entry.find('=')); };
    auto put = [&](const std::string& entry) {
        const auto name = name_of(entry);
        const auto existing = std::find_if(merged.begin(), merged.end(),
                                           [&](const std::string& e) { return name_of(e) == name; });
        if (existing != merged.end()) {
            *existing = entry;
        } else {
            merged.push_back(entry);
        }
    };
    for (const auto& entry : base) {
        put(entry);
    }
    for (const auto& entry : overrides) {
        if (entry.find('=') == std::string::npos || entry.front() == '=') {
            throw SandboxError("environment: '" + entry + "' is not NAME=value");
        }
        put(entry);
    }
    return merged;
}

ssize_t send_with_fds(int socket, std::span<const unsigned char> bytes, std::span<const int> fds) noexcept {
    if (bytes.empty() || fds.size() > max_fds_per_message) {
        errno = EINVAL;
        return -1;
    }
    iovec data{const_cast<unsigned char*>(bytes.data()), bytes.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * max_fds_per_message)] = {};
    msghdr message{};
    message.msg_iov = &data;
    message.msg_iovlen = 1;
    if (!fds.empty()) {
        message.msg_control = control;
        message.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
        cmsghdr* header = CMSG_FIRSTHDR(&message);
        header->cmsg_level = SOL_SOCKET;
        header->cmsg_type = SCM_RIGHTS;
        header->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(header), fds.data(), sizeof(int) * fds.size());
    }
    ssize_t sent = 0;
    do {
        sent = ::sendmsg(socket, &message, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    return sent;
}

}  // namespace cellblock::sandbox::detail

#include "plan_codec.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <type_traits>

#include "cellblock/sandbox/sandbox.hpp"

namespace cellblock::sandbox::detail {
namespace {

constexpr std::uint32_t format_version = 1;
// Bounds that no real plan comes near; they keep a corrupt count from allocating the machine away.
constexpr std::uint32_t max_entries = 4096;
constexpr std::uint32_t max_string = 1U << 20;

class Writer {
  public:
    template <typename T>
    void number(T value) {
        static_assert(std::is_arithmetic_v<T>);
        const auto* raw = reinterpret_cast<const unsigned char*>(&value);
        bytes_.insert(bytes_.end(), raw, raw + sizeof value);
    }
    void flag(bool value) { number<std::uint8_t>(value ? 1 : 0); }
    void text(const std::string& value) {
        number(static_cast<std::uint32_t>(value.size()));
        bytes_.insert(bytes_.end(), value.begin(), value.end());
    }
    void count(std::size_t value) { number(static_cast<std::uint32_t>(value)); }
    std::vector<unsigned char> take() { return std::move(bytes_); }

  private:
    std::vector<unsigned char> bytes_;
};

class Reader {
  public:
    explicit Reader(std::span<const unsigned char> bytes) : bytes_(bytes) {}

    template <typename T>
    T number(const char* what) {
        static_assert(std::is_arithmetic_v<T>);
        need(sizeof(T), what);
        T value{};
        std::memcpy(&value, bytes_.data() + offset_, sizeof value);
        offset_ += sizeof value;
        return value;
    }
    bool flag(const char* what) {
        const auto value = number<std::uint8_t>(what);
        if (value > 1) {
            throw SandboxError(std::string("zygote plan: ") + what + " is not a boolean");
        }
        return value == 1;
    }
    int step(const char* what) { return number<std::int32_t>(what); }
    std::string text(const char* what) {
        const auto size = number<std::uint32_t>(what);
        if (size > max_string) {
            throw SandboxError(std::string("zygote plan: ") + what + " is too long");
        }
        need(size, what);
        std::string value(reinterpret_cast<const char*>(bytes_.data() + offset_), size);
        offset_ += size;
        return value;
    }
    std::uint32_t count(const char* what) {
        const auto value = number<std::uint32_t>(what);
        if (value > max_entries) {
            throw SandboxError(std::string("zygote plan: too many ") + what);
        }
        return value;
    }
    void finish() const {
        if (offset_ != bytes_.size()) {
            throw SandboxError("zygote plan: " + std::to_string(bytes_.size() - offset_) + " trailing bytes");
        }
    }

  private:
    void need(std::size_t size, const char* what) const {
        if (bytes_.size() - offset_ < size) {
            throw SandboxError(std::string("zygote plan: truncated at ") + what);
        }
    }
    std::span<const unsigned char> bytes_;
    std::size_t offset_ = 0;
};

// Maps the child's fds to their index in the array that travels with the plan.
class FdTable {
  public:
    std::int32_t index_of(int fd) {
        if (fd < 0) {
            return -1;
        }
        const auto [entry, inserted] = indices_.try_emplace(fd, static_cast<std::int32_t>(fds_.size()));
        if (inserted) {
            fds_.push_back(fd);
        }
        return entry->second;
    }
    std::vector<int> take() { return std::move(fds_); }

  private:
    std::map<int, std::int32_t> indices_;
    std::vector<int> fds_;
};

void write_mounts(Writer& out, const std::vector<MountOp>& ops) {
    out.count(ops.size());
    for (const auto& op : ops) {
        out.number(static_cast<std::uint8_t>(op.action));
        out.number(static_cast<std::int32_t>(op.step));
        out.text(op.source);
        out.text(op.target);
        out.text(op.fstype);
        out.number(static_cast<std::uint64_t>(op.flags));
        out.text(op.data);
        out.flag(op.has_source);
        out.flag(op.has_fstype);
        out.flag(op.has_data);
    }
}

std::vector<MountOp> read_mounts(Reader& in) {
    std::vector<MountOp> ops(in.count("mounts"));
    for (auto& op : ops) {
        const auto action = in.number<std::uint8_t>("mount action");
        if (action > static_cast<std::uint8_t>(MountOp::Action::remount_bind)) {
            throw SandboxError("zygote plan: unknown mount action " + std::to_string(action));
        }
        op.action = static_cast<MountOp::Action>(action);
        op.step = in.step("mount step");
        op.source = in.text("mount source");
        op.target = in.text("mount target");
        op.fstype = in.text("mount fstype");
        op.flags = static_cast<unsigned long>(in.number<std::uint64_t>("mount flags"));
        op.data = in.text("mount data");
        op.has_source = in.flag("mount has_source");
        op.has_fstype = in.flag("mount has_fstype");
        op.has_data = in.flag("mount has_data");
    }
    return ops;
}

void write_strings(Writer& out, const std::vector<char*>& strings) {
    std::size_t count = 0;
    while (count < strings.size() && strings[count] != nullptr) {
        ++count;
    }
    out.count(count);
    for (std::size_t i = 0; i < count; ++i) {
        out.text(strings[i]);
    }
}

std::vector<std::string> read_strings(Reader& in, const char* what) {
    std::vector<std::string> strings(in.count(what));
    for (auto& value : strings) {
        value = in.text(what);
    }
    return strings;
}

std::vector<char*> pointers_to(std::vector<std::string>& strings) {
    std::vector<char*> pointers;
    pointers.reserve(strings.size() + 1);
    for (auto& value : strings) {
        pointers.push_back(value.data());
    }
    pointers.push_back(nullptr);
    return pointers;
}

}  // namespace

EncodedPlan encode_plan(const ChildPlan& plan) {
    Writer out;
    FdTable fds;
    out.number(format_version);
    out.flag(plan.exec_program);
    out.flag(plan.parent_death_signal);
    out.flag(plan.drop_privileges);
    out.flag(plan.new_user_namespace);

    out.number(fds.index_of(plan.sync_read_fd));
    out.number(fds.index_of(plan.error_write_fd));

    out.count(plan.cgroup_joins.size());
    for (const auto& join : plan.cgroup_joins) {
        out.text(join.tasks_file);
        out.number(static_cast<std::int32_t>(join.step));
    }
    out.flag(plan.new_cgroup_namespace);
    for (const int step :
         {plan.step_sync, plan.step_cgroupns, plan.step_setgroups, plan.step_hostname, plan.step_setsid,
          plan.step_pdeathsig, plan.step_chdir, plan.step_execve, plan.step_sigmask}) {
        out.number(static_cast<std::int32_t>(step));
    }

    write_mounts(out, plan.mounts_before_pivot);
    out.text(plan.new_root);
    for (const int step : {plan.step_chdir_root, plan.step_pivot, plan.step_umount_old}) {
        out.number(static_cast<std::int32_t>(step));
    }
    write_mounts(out, plan.mounts_after_pivot);

    out.text(plan.hostname);
    out.flag(plan.loopback_up);
    out.number(static_cast<std::int32_t>(plan.step_loopback));
    out.count(plan.listeners.size());
    for (const auto& listener : plan.listeners) {
        out.flag(listener.ipv6);
        out.number(listener.port);
        for (const int step :
             {listener.step_socket, listener.step_bind, listener.step_listen, listener.step_send}) {
            out.number(static_cast<std::int32_t>(step));
        }
    }
    out.number(fds.index_of(plan.listener_child_fd));

    out.count(plan.fds.sources.size());
    for (const int fd : plan.fds.sources) {
        out.number(fds.index_of(fd));
    }
    out.number(static_cast<std::int32_t>(plan.fds.step_dup));
    out.number(static_cast<std::int32_t>(plan.fds.step_close));

    out.count(plan.rlimits.size());
    for (const auto& limit : plan.rlimits) {
        out.number(static_cast<std::int32_t>(limit.resource));
        out.number(static_cast<std::uint64_t>(limit.value.rlim_cur));
        out.number(static_cast<std::uint64_t>(limit.value.rlim_max));
        out.number(static_cast<std::int32_t>(limit.step));
    }

    out.number(static_cast<std::uint32_t>(plan.uid));
    out.number(static_cast<std::uint32_t>(plan.gid));
    out.number(static_cast<std::int32_t>(plan.last_capability));
    for (const int step : {plan.step_bounding, plan.step_setresgid, plan.step_setresuid, plan.step_capset,
                           plan.step_ambient, plan.step_no_new_privs, plan.step_securebits}) {
        out.number(static_cast<std::int32_t>(step));
    }

    const auto* filter = plan.seccomp_filter;
    out.count(filter != nullptr ? filter->size() : 0);
    if (filter != nullptr) {
        for (const auto& instruction : *filter) {
            out.number(instruction.code);
            out.number(instruction.jt);
            out.number(instruction.jf);
            out.number(instruction.k);
        }
    }
    out.number(static_cast<std::int32_t>(plan.step_seccomp));

    out.text(plan.cwd);
    write_strings(out, plan.argv);
    write_strings(out, plan.envp);

    EncodedPlan encoded{out.take(), fds.take()};
    if (encoded.fds.size() > max_plan_fds) {
        throw SandboxError("zygote plan: " + std::to_string(encoded.fds.size()) + " fds, at most " +
                           std::to_string(max_plan_fds) + " can be sent");
    }
    return encoded;
}

void DecodedPlan::wipe() noexcept {
    auto zero = [](std::string& text) { ::explicit_bzero(text.data(), text.size()); };
    for (auto* strings : {&argv, &envp})
        for (std::string& text : *strings)
            zero(text);
    for (auto* mounts : {&plan.mounts_before_pivot, &plan.mounts_after_pivot})
        for (MountOp& mount : *mounts)
            for (std::string* text : {&mount.source, &mount.target, &mount.fstype, &mount.data})
                zero(*text);
    for (CgroupJoin& join : plan.cgroup_joins)
        zero(join.tasks_file);
    for (std::string* text : {&plan.new_root, &plan.hostname, &plan.cwd})
        zero(*text);
}

namespace {

// The fds received with a plan, which the plan names by index.
class ReceivedFds {
  public:
    explicit ReceivedFds(std::span<const int> fds) : fds_(fds) {
        if (fds.size() > max_plan_fds) {
            throw SandboxError("zygote plan: more than " + std::to_string(max_plan_fds) + " fds");
        }
        for (const int fd : fds) {
            if (fd < 0) {
                throw SandboxError("zygote plan: a received fd is negative");
            }
        }
    }

    int at(const char* what, bool required, Reader& in) const {
        const auto index = in.number<std::int32_t>(what);
        if (index == -1 && !required) {
            return -1;
        }
        if (index < 0 || static_cast<std::size_t>(index) >= fds_.size()) {
            throw SandboxError(std::string("zygote plan: ") + what + " names fd #" + std::to_string(index) +
                               " of " + std::to_string(fds_.size()));
        }
        return fds_[static_cast<std::size_t>(index)];
    }

    // Scratch copies go above every received fd and above the program's final numbers.
    [[nodiscard]] int dup_base(std::size_t program_fds) const {
        int highest = std::max(2, static_cast<int>(program_fds) + 1);
        for (const int fd : fds_) {
            highest = std::max(highest, fd);
        }
        return highest + 1;
    }

  private:
    std::span<const int> fds_;
};

void read_header(Reader& in, const ReceivedFds& fds, ChildPlan& plan) {
    if (const auto version = in.number<std::uint32_t>("version"); version != format_version) {
        throw SandboxError("zygote plan: format " + std::to_string(version) + ", expected " +
                           std::to_string(format_version));
    }
    plan.exec_program = in.flag("exec_program");
    plan.parent_death_signal = in.flag("parent_death_signal");
    plan.drop_privileges = in.flag("drop_privileges");
    plan.new_user_namespace = in.flag("new_user_namespace");
    plan.sync_read_fd = fds.at("the sync pipe", true, in);
    plan.error_write_fd = fds.at("the error pipe", true, in);
    plan.sync_write_fd = -1;
    plan.error_read_fd = -1;
}

void read_namespaces(Reader& in, ChildPlan& plan) {
    plan.cgroup_joins.resize(in.count("cgroup joins"));
    for (auto& join : plan.cgroup_joins) {
        join.tasks_file = in.text("cgroup tasks file");
        join.step = in.step("cgroup step");
    }
    plan.new_cgroup_namespace = in.flag("new_cgroup_namespace");
    for (int* step :
         {&plan.step_sync, &plan.step_cgroupns, &plan.step_setgroups, &plan.step_hostname, &plan.step_setsid,
          &plan.step_pdeathsig, &plan.step_chdir, &plan.step_execve, &plan.step_sigmask}) {
        *step = in.step("step");
    }

    plan.mounts_before_pivot = read_mounts(in);
    plan.new_root = in.text("new root");
    for (int* step : {&plan.step_chdir_root, &plan.step_pivot, &plan.step_umount_old}) {
        *step = in.step("step");
    }
    plan.mounts_after_pivot = read_mounts(in);
}

void read_network(Reader& in, const ReceivedFds& fds, ChildPlan& plan) {
    plan.hostname = in.text("hostname");
    plan.loopback_up = in.flag("loopback_up");
    plan.step_loopback = in.step("step");
    plan.listeners.resize(in.count("listeners"));
    for (auto& listener : plan.listeners) {
        listener.ipv6 = in.flag("listener ipv6");
        listener.port = in.number<std::uint16_t>("listener port");
        for (int* step :
             {&listener.step_socket, &listener.step_bind, &listener.step_listen, &listener.step_send}) {
            *step = in.step("listener step");
        }
    }
    plan.listener_child_fd = fds.at("the listener channel", !plan.listeners.empty(), in);
    plan.listener_parent_fd = -1;
}

void read_program_fds(Reader& in, const ReceivedFds& fds, ChildPlan& plan) {
    plan.fds.sources.resize(in.count("program fds"));
    if (plan.fds.sources.size() > 510) {
        throw SandboxError("zygote plan: too many program fds");
    }
    for (auto& source : plan.fds.sources) {
        source = fds.at("a program fd", true, in);
    }
    plan.fds.step_dup = in.step("step");
    plan.fds.step_close = in.step("step");
    plan.fds.dup_base = fds.dup_base(plan.fds.sources.size());
}

void read_limits_and_credentials(Reader& in, ChildPlan& plan) {
    plan.rlimits.resize(in.count("rlimits"));
    for (auto& limit : plan.rlimits) {
        limit.resource = in.number<std::int32_t>("rlimit resource");
        limit.value.rlim_cur = static_cast<rlim_t>(in.number<std::uint64_t>("rlimit soft"));
        limit.value.rlim_max = static_cast<rlim_t>(in.number<std::uint64_t>("rlimit hard"));
        limit.step = in.step("rlimit step");
    }

    plan.uid = static_cast<uid_t>(in.number<std::uint32_t>("uid"));
    plan.gid = static_cast<gid_t>(in.number<std::uint32_t>("gid"));
    plan.last_capability = in.number<std::int32_t>("last capability");
    for (int* step : {&plan.step_bounding, &plan.step_setresgid, &plan.step_setresuid, &plan.step_capset,
                      &plan.step_ambient, &plan.step_no_new_privs, &plan.step_securebits}) {
        *step = in.step("step");
    }
}

void read_seccomp(Reader& in, DecodedPlan& decoded) {
    decoded.seccomp_filter.resize(in.count("seccomp instructions"));
    for (auto& instruction : decoded.seccomp_filter) {
        instruction.code = in.number<decltype(instruction.code)>("seccomp code");
        instruction.jt = in.number<decltype(instruction.jt)>("seccomp jt");
        instruction.jf = in.number<decltype(instruction.jf)>("seccomp jf");
        instruction.k = in.number<decltype(instruction.k)>("seccomp k");
    }
    decoded.plan.seccomp_filter = decoded.seccomp_filter.empty() ? nullptr : &decoded.seccomp_filter;
    decoded.plan.step_seccomp = in.step("step");
}

void read_program(Reader& in, DecodedPlan& decoded) {
    decoded.plan.cwd = in.text("cwd");
    decoded.argv = read_strings(in, "argv");
    decoded.envp = read_strings(in, "envp");
    in.finish();
    if (decoded.plan.exec_program && decoded.argv.empty()) {
        throw SandboxError("zygote plan: a program to exec needs an argv");
    }
    decoded.plan.argv = pointers_to(decoded.argv);
    decoded.plan.envp = pointers_to(decoded.envp);
}

}  // namespace

// Fields are read in the order encode_plan writes them.
std::unique_ptr<DecodedPlan> decode_plan(std::span<const unsigned char> bytes, std::span<const int> fds) {
    const ReceivedFds received(fds);
    auto decoded = std::make_unique<DecodedPlan>();
    Reader in(bytes);
    read_header(in, received, decoded->plan);
    read_namespaces(in, decoded->plan);
    read_network(in, received, decoded->plan);
    read_program_fds(in, received, decoded->plan);
    read_limits_and_credentials(in, decoded->plan);
    read_seccomp(in, *decoded);
    read_program(in, *decoded);
    return decoded;
}

}  // namespace cellblock::sandbox::detail

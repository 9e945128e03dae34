// cellblock-egress: the egress proxy in a process of its own (kernel/src/egress/README.md). The kernel
// (root, holding the connection key) starts it with a clean environment and only one descriptor, fd 3, a
// SOCK_SEQPACKET socketpair (egress/egress_wire.hpp). It reads the policy once, then gives up root for a
// dedicated uid, NO_NEW_PRIVS, rlimits and a seccomp allowlist before touching anything a worker wrote:
// hostile HTTP heads and ClientHellos are parsed by a process that can hurt nothing but its own sessions.
// Its filesystem is the resolver's files alone (enter_resolver_root), and it signals no process but itself,
// so the helpers of other kernels, which share its uid, are out of its reach.
#include <fcntl.h>
#include <grp.h>
#include <linux/close_range.h>
#include <sched.h>
#include <seccomp.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "egress/egress_proxy.hpp"
#include "egress/egress_wire.hpp"

namespace {

using namespace cellblock::kernel;
using namespace cellblock::kernel::egress;

constexpr int channel_fd = 3;

[[noreturn]] void die(const std::string& what) {
    std::fprintf(stderr, "cellblock-egress: %s\n", what.c_str());
    std::_Exit(2);
}

void check(int result, const char* step) {
    if (result != 0) {
        die(std::string(step) + ": " + std::strerror(errno));
    }
}

// Everything the proxy reports goes to the kernel; a held request's answer comes back as an "answer".
class Forwarder final : public ApprovalBroker, public EgressObserver {
  public:
    void request(const ApprovalRequest& request, std::function<void(Decision, std::string)> answer) override {
        {
            const std::lock_guard lock(mutex_);
            answers_[request.id] = std::move(answer);
        }
        auto body = wire::to_json(request);
        body["type"] = "approval";
        out(body);
    }
    void on_connection(const ConnectionRecord& record) override {
        auto body = wire::to_json(record);
        body["type"] = "connection";
        out(body);
    }
    void on_approval_requested(const ApprovalRequest& request, double timeout_s) override {
        auto body = wire::to_json(request);
        body["type"] = "approval_requested";
        body["timeout_s"] = timeout_s;
        out(body);
    }
    void on_approval_decided(const ApprovalRequest& request, Decision decision,
                             const std::string& decided_by) override {
        {
            const std::lock_guard lock(mutex_);
            answers_.erase(request.id);  // decided (or timed out) inside the proxy: a late answer is moot
        }
        auto body = wire::to_json(request);
        body["type"] = "approval_decided";
        body["decision"] = std::string(to_string(decision));
        body["decided_by"] = decided_by;
        out(body);
    }

    void answer(const nlohmann::json& body) {
        std::function<void(Decision, std::string)> answer;
        const auto decision = wire::decision_from_string(body.value("decision", ""));
        {
            const std::lock_guard lock(mutex_);
            const auto found = answers_.find(body.value("id", ""));
            if (found == answers_.end() || !decision) {
                return;
            }
            answer = std::move(found->second);
            answers_.erase(found);
        }
        answer(*decision, body.value("decided_by", ""));
    }

  private:
    static void out(const nlohmann::json& body) {
        // The kernel gone means nobody can approve or report: end, and every open connection with us.
        if (!wire::send(channel_fd, body)) {
            std::_Exit(0);
        }
    }

    std::mutex mutex_;
    std::map<std::string, std::function<void(Decision, std::string)>> answers_;
};

void set_limit(int resource, rlim_t value, const char* step) {
    const rlimit limit{value, value};
    check(::setrlimit(resource, &limit), step);
}

// What a proxy does and what getaddrinfo/getifaddrs need; anything else kills the process (the kernel
// reports the crash and starts a new helper; a crash allows nothing).
void install_seccomp() {
    scmp_filter_ctx ctx = ::seccomp_init(SCMP_ACT_KILL_PROCESS);
    if (ctx == nullptr) {
        die("seccomp_init failed");
    }
    auto allow = [ctx](int number, std::initializer_list<scmp_arg_cmp> conditions = {}) {
        if (::seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, number, static_cast<unsigned>(conditions.size()),
                                     conditions.begin()) != 0) {
            die("seccomp rule " + std::to_string(number));
        }
    };
    for (const int number : {SCMP_SYS(read),
                             SCMP_SYS(write),
                             SCMP_SYS(readv),
                             SCMP_SYS(writev),
                             SCMP_SYS(close),
                             SCMP_SYS(connect),
                             SCMP_SYS(accept),
                             SCMP_SYS(accept4),
                             SCMP_SYS(bind),
                             SCMP_SYS(sendto),
                             SCMP_SYS(recvfrom),
                             SCMP_SYS(sendmsg),
                             SCMP_SYS(recvmsg),
                             SCMP_SYS(sendmmsg),
                             SCMP_SYS(recvmmsg),
                             SCMP_SYS(getsockname),
                             SCMP_SYS(getpeername),
                             SCMP_SYS(getsockopt),
                             SCMP_SYS(setsockopt),
                             SCMP_SYS(shutdown),
                             SCMP_SYS(epoll_create1),
                             SCMP_SYS(epoll_ctl),
                             SCMP_SYS(epoll_wait),
                             SCMP_SYS(epoll_pwait),
                             SCMP_SYS(eventfd2),
                             SCMP_SYS(timerfd_create),
                             SCMP_SYS(timerfd_settime),
                             SCMP_SYS(timerfd_gettime),
                             SCMP_SYS(pipe2),
                             SCMP_SYS(fcntl),
                             SCMP_SYS(poll),
                             SCMP_SYS(ppoll),
                             SCMP_SYS(futex),
                             SCMP_SYS(mmap),
                             SCMP_SYS(munmap),
                             SCMP_SYS(mprotect),
                             SCMP_SYS(madvise),
                             SCMP_SYS(mremap),
                             SCMP_SYS(brk),
                             SCMP_SYS(clock_gettime),
                             SCMP_SYS(clock_nanosleep),
                             SCMP_SYS(nanosleep),
                             SCMP_SYS(gettimeofday),
                             SCMP_SYS(getpid),
                             SCMP_SYS(gettid),
                             SCMP_SYS(getuid),
                             SCMP_SYS(geteuid),
                             SCMP_SYS(getgid),
                             SCMP_SYS(getegid),
                             SCMP_SYS(rt_sigaction),
                             SCMP_SYS(rt_sigprocmask),
                             SCMP_SYS(rt_sigreturn),
                             SCMP_SYS(sigaltstack),
                             SCMP_SYS(exit),
                             SCMP_SYS(exit_group),
                             SCMP_SYS(set_robust_list),
                             SCMP_SYS(rseq),
                             SCMP_SYS(getrandom),
                             SCMP_SYS(newfstatat),
                             SCMP_SYS(fstat),
                             SCMP_SYS(lseek),
                             SCMP_SYS(uname),
                             SCMP_SYS(sched_yield),
                             SCMP_SYS(sched_getaffinity),
                             SCMP_SYS(restart_syscall)}) {
        allow(number);
    }
    // Sockets: the Internet, and the routing netlink getaddrinfo/getifaddrs read. No AF_UNIX: nothing on
    // the host's Unix sockets (nscd included: glibc falls back to its own resolver).
    for (const int family : {AF_INET, AF_INET6, AF_NETLINK}) {
        allow(SCMP_SYS(socket), {SCMP_A0(SCMP_CMP_EQ, static_cast<scmp_datum_t>(family))});
    }
    // glibc asks nscd over AF_UNIX before it resolves by itself: refused (not killed), so it falls back.
    if (::seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EACCES), SCMP_SYS(socket), 1, SCMP_A0(SCMP_CMP_EQ, AF_UNIX)) !=
        0) {
        die("seccomp rule socket(AF_UNIX)");
    }
    // Asio's non-blocking mode and readiness counts.
    // Signals only to itself (glibc's abort and thread cancellation): not to another kernel's helper of the
    // same uid.
    allow(SCMP_SYS(tgkill), {SCMP_A0(SCMP_CMP_EQ, static_cast<scmp_datum_t>(::getpid()))});
    allow(SCMP_SYS(ioctl), {SCMP_A1(SCMP_CMP_EQ, FIONBIO)});
    allow(SCMP_SYS(ioctl), {SCMP_A1(SCMP_CMP_EQ, FIONREAD)});
    // Threads only (Asio's resolver thread), never a process; clone3's flags sit behind a pointer the
    // filter cannot read, so it fails with ENOSYS and glibc falls back to clone.
    allow(SCMP_SYS(clone), {SCMP_A0(SCMP_CMP_MASKED_EQ, CLONE_THREAD, CLONE_THREAD)});
    if (::seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0) != 0) {
        die("seccomp rule clone3");
    }
    // Name resolution reads /etc/resolv.conf, /etc/hosts, nsswitch.conf and gai.conf (glibc's "files" and
    // "dns"; no NSS module can be loaded from the helper's root): read-only opens; no write, no create,
    // anywhere.
    constexpr scmp_datum_t write_flags = O_ACCMODE | O_CREAT | O_TRUNC | O_APPEND;
    allow(SCMP_SYS(openat), {SCMP_A2(SCMP_CMP_MASKED_EQ, write_flags, O_RDONLY)});
    if (::seccomp_load(ctx) != 0) {
        die("seccomp_load failed");
    }
    ::seccomp_release(ctx);
}

// The files glibc's resolver reads ("files" and "dns" are part of libc since 2.34; no module is loaded).
constexpr const char* resolver_files[] = {"hosts", "resolv.conf", "nsswitch.conf", "host.conf", "gai.conf"};

// A root of the resolver's files alone: a private mount namespace whose root is a read-only tmpfs holding
// each /etc file above bound read-only from the host (an edit in place shows; a file replaced by rename, as
// resolvconf and most editors do, shows to the next helper: the kernel's next start), and nothing else: no
// /proc, no home, no kernel state or workspace of any session to read through a flaw in the proxy.
void enter_resolver_root() {
    check(::unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)");
    check(::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr), "mount / private");
    // Any existing directory serves as the mount point: the tmpfs covers it in this namespace only.
    constexpr const char* new_root = "/tmp";
    check(::mount("cellblock-egress", new_root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  "size=64k,mode=0755"),
          "mount tmpfs root");
    check(::mkdir("/tmp/etc", 0755), "mkdir /etc");
    for (const char* name : resolver_files) {
        const std::string source = std::string("/etc/") + name;
        const std::string target = std::string("/tmp/etc/") + name;
        if (::access(source.c_str(), R_OK) != 0) {
            continue;  // absent here: glibc takes its defaults
        }
        const int placeholder = ::open(target.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
        if (placeholder < 0) {
            die("create " + target + ": " + std::strerror(errno));
        }
        ::close(placeholder);
        check(::mount(source.c_str(), target.c_str(), nullptr, MS_BIND, nullptr), "bind /etc file");
        check(::mount(nullptr, target.c_str(), nullptr,
                      MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr),
              "remount /etc file read-only");
    }
    check(::chdir(new_root), "chdir new root");
    // pivot_root(".", "."): the old root is stacked under the new one, then detached.
    check(static_cast<int>(::syscall(SYS_pivot_root, ".", ".")), "pivot_root");
    check(::umount2(".", MNT_DETACH), "detach old root");
    check(::chdir("/"), "chdir /");
    check(::mount(nullptr, "/", nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  nullptr),
          "remount root read-only");
}

void confine(uid_t uid, gid_t gid) {
    // Nothing of the kernel's but the channel and its stderr, where the proxy logs (the kernel already closed
    // the rest before exec; stdin and stdout are /dev/null).
    check(::close_range(channel_fd + 1, ~0U, 0), "close_range");
    enter_resolver_root();
    // Twice the connection cap (a client and a server socket each) + listeners, epoll and the resolver.
    set_limit(RLIMIT_NOFILE, 600, "RLIMIT_NOFILE");
    set_limit(RLIMIT_AS, rlim_t{1024} * 1024 * 1024, "RLIMIT_AS");
    set_limit(RLIMIT_DATA, rlim_t{512} * 1024 * 1024, "RLIMIT_DATA");
    set_limit(RLIMIT_CORE, 0, "RLIMIT_CORE");
    check(::setgroups(0, nullptr), "setgroups");
    check(::setresgid(gid, gid, gid), "setresgid");
    check(::setresuid(uid, uid, uid), "setresuid");
    if (::setresuid(0, 0, 0) == 0) {
        die("root came back after setresuid");
    }
    check(::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs");
    install_seccomp();
}

long parse_id(std::string_view text) {
    long value = -1;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (error != std::errc() || end != text.data() + text.size() || value <= 0) {
        die("bad id: " + std::string(text));
    }
    return value;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        die("usage: cellblock-egress UID GID (started by cellblock-kernel, channel on fd 3)");
    }
    const auto uid = static_cast<uid_t>(parse_id(argv[1]));
    const auto gid = static_cast<gid_t>(parse_id(argv[2]));

    auto start = wire::receive(channel_fd);
    if (!start || start->body["type"] != "start") {
        die("no start message");
    }
    std::optional<EgressPolicy> policy;
    std::optional<PinnedHosts> pinned;
    try {
        policy.emplace(EgressPolicy::parse(start->body.at("policy")));
        pinned.emplace(
            PinnedHosts::parse(start->body.value("hosts", ""), start->body.value("hosts_origin", "")));
    } catch (const std::exception& error) {
        die(std::string("bad start message: ") + error.what());
    }
    confine(uid, gid);

    Forwarder forwarder;
    EgressProxy proxy(std::move(*policy), std::move(*pinned), forwarder, forwarder);
    if (!wire::send(channel_fd, {{"type", "ready"}})) {
        return 0;
    }
    while (auto message = wire::receive(channel_fd)) {
        const std::string type = message->body["type"];
        if (type == "serve" && message->fd) {
            proxy.serve(std::move(message->fd));
        } else if (type == "answer") {
            forwarder.answer(message->body);
        }
    }
    // The kernel closed the channel (it is stopping): end every connection now.
    std::_Exit(0);
}

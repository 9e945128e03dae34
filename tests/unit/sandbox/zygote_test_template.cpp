// A zygote template in C++ for the sandbox's unit tests: what the Python template does (sandbox/README.md
// "Worker zygote", wire protocol), minus Python. Single-threaded, one worker at a time.
//
//   zygote_test_template --library LIB --socket PATH --private-view DIR
//       listens on PATH; runs in a mount namespace of its own with a tmpfs on DIR that only it sees (and its
//       cwd there), and exits with status 3 if a spawn ever leaves it in another view.
//   zygote_test_template --from-fds
//       as started by Launcher::launch_template: fd 3 listens, fd 4 is the host's mount namespace, the
//       library is $CELLBLOCK_ZYGOTE_LIBRARY, and its own view is the one it was started in.
//   zygote_test_template --probe
//       prints what confines it (probe_report), then waits for its stdin to close.
// A fork runs probe_report too, so an exec'd and a forked worker print the same report when confined alike.
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "cellblock/sandbox/zygote_spawn.h"

namespace {

using SpawnFunction = decltype(&cellblock_zygote_spawn);

[[noreturn]] void die(const std::string& what) {
    std::cerr << "zygote_test_template: " << what << ": " << std::strerror(errno) << std::endl;
    std::exit(2);
}

std::string read_text(const char* path) {
    std::ifstream file(path);
    std::stringstream text;
    text << file.rdbuf();
    return text.str();
}

// One "key=value" per line: everything about the confinement a process can see from inside.
int probe_report() {
    std::string report;
    std::istringstream status(read_text("/proc/self/status"));
    for (std::string line; std::getline(status, line);) {
        const auto colon = line.find(':');
        const std::string key = line.substr(0, colon);
        for (const char* wanted :
             {"Umask", "Uid", "Gid", "Groups", "NSpid", "NSpgid", "NSsid", "SigBlk", "SigIgn", "SigCgt",
              "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp", "Seccomp_filters"}) {
            if (key == wanted) {
                std::string value = line.substr(colon + 1);
                value.erase(0, value.find_first_not_of(" \t"));
                report += "status." + key + "=" + value + "\n";
            }
        }
    }
    std::istringstream limits(read_text("/proc/self/limits"));
    for (std::string line; std::getline(limits, line);) {
        report += "limits=" + line + "\n";
    }
    std::istringstream cgroups(read_text("/proc/self/cgroup"));
    for (std::string line; std::getline(cgroups, line);) {
        report += "cgroup=" + line + "\n";
    }
    std::istringstream mounts(read_text("/proc/self/mountinfo"));
    for (std::string line; std::getline(mounts, line);) {
        // mount point and its options (the root fields name per-session host paths)
        std::istringstream fields(line);
        std::string id, parent, device, root, point, options;
        fields >> id >> parent >> device >> root >> point >> options;
        report += "mount=" + point + " " + options + "\n";
    }
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    report += std::string("hostname=") + host + "\n";
    char cwd[4096] = {};
    report += std::string("cwd=") + (::getcwd(cwd, sizeof cwd) ? cwd : "?") + "\n";
    report += "pid=" + std::to_string(::getpid()) + "\n";
    report += "ppid=" + std::to_string(::getppid()) + "\n";
    if (DIR* fds = ::opendir("/proc/self/fd")) {
        std::vector<int> numbers;
        while (const dirent* entry = ::readdir(fds)) {
            if (entry->d_name[0] != '.') {
                numbers.push_back(std::atoi(entry->d_name));
            }
        }
        ::closedir(fds);
        std::sort(numbers.begin(), numbers.end());
        report += "fds=";
        for (const int fd : numbers) {
            report += std::to_string(fd) + " ";
        }
        report += "\n";
    }
    for (const char* ns : {"user", "mnt", "pid", "net", "ipc", "uts", "cgroup"}) {
        char target[256] = {};
        const std::string link = std::string("/proc/self/ns/") + ns;
        ::readlink(link.c_str(), target, sizeof target - 1);
        report += std::string("ns.") + ns + "=" + target + "\n";
    }
    const int inet = ::socket(AF_INET, SOCK_STREAM, 0);
    report += "socket_inet=" + std::string(inet >= 0 ? "allowed" : std::strerror(errno)) + "\n";
    report += "end\n";
    if (::write(1, report.data(), report.size()) != static_cast<ssize_t>(report.size())) {
        return 1;
    }
    char byte = 0;
    while (::read(0, &byte, 1) > 0) {
    }
    return 0;
}

void send_json(int connection, const std::string& json, int fd = -1) {
    iovec data{const_cast<char*>(json.data()), json.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr message{};
    message.msg_iov = &data;
    message.msg_iovlen = 1;
    if (fd >= 0) {
        message.msg_control = control;
        message.msg_controllen = sizeof control;
        cmsghdr* header = CMSG_FIRSTHDR(&message);
        header->cmsg_level = SOL_SOCKET;
        header->cmsg_type = SCM_RIGHTS;
        header->cmsg_len = CMSG_LEN(sizeof(int));
        std::memcpy(CMSG_DATA(header), &fd, sizeof fd);
    }
    ::sendmsg(connection, &message, MSG_NOSIGNAL);  // a kernel that left gets nothing
}

struct View {
    int host_mount_ns = -1;  // -1: clone from our own
    int own_mount_ns = -1;
    int own_cwd = -1;
    std::string marker;  // must stay visible (relative to the cwd) after every spawn
};

// Serves one connection: spawn, answer, then report the worker's end (or kill it when the kernel leaves).
// Returns 0 in the fork (which must then run probe_report), 1 in the template.
int serve(int connection, SpawnFunction spawn, const View& view) {
    std::vector<unsigned char> buffer(1 << 20);
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 16)];
    iovec data{buffer.data(), buffer.size()};
    msghdr message{};
    message.msg_iov = &data;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof control;
    const ssize_t got = ::recvmsg(connection, &message, MSG_CMSG_CLOEXEC);
    std::vector<int> fds;
    for (cmsghdr* header = CMSG_FIRSTHDR(&message); header; header = CMSG_NXTHDR(&message, header)) {
        if (header->cmsg_level == SOL_SOCKET && header->cmsg_type == SCM_RIGHTS) {
            const std::size_t count = (header->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (std::size_t i = 0; i < count; ++i) {
                int fd = -1;
                std::memcpy(&fd, CMSG_DATA(header) + i * sizeof(int), sizeof fd);
                fds.push_back(fd);
            }
        }
    }
    if (got < 4 || std::memcmp(buffer.data(), "CBZ1", 4) != 0) {
        send_json(connection, R"({"error": "not a CBZ1 request"})");
        for (const int fd : fds) {
            ::close(fd);
        }
        return 1;
    }
    int pidfd = -1;
    const long pid = spawn(buffer.data() + 4, static_cast<std::size_t>(got - 4), fds.data(), fds.size(),
                           view.host_mount_ns, view.own_mount_ns, view.own_cwd, &pidfd);
    if (pid == 0) {
        return 0;
    }
    for (const int fd : fds) {
        ::close(fd);  // the kernel sees the error pipe's end of file only once our copy is gone too
    }
    if (pid == -ENOTRECOVERABLE) {
        std::cerr << "zygote_test_template: lost my own view" << std::endl;
        std::exit(3);
    }
    if (!view.marker.empty() && ::access(view.marker.c_str(), F_OK) != 0) {
        std::cerr << "zygote_test_template: my view is gone after a spawn" << std::endl;
        std::exit(3);
    }
    if (pid < 0) {
        send_json(connection, std::string(R"({"error": ")") + std::strerror(static_cast<int>(-pid)) + "\"}");
        return 1;
    }
    send_json(connection, "{\"pid\": " + std::to_string(pid) + "}", pidfd);
    pollfd watch[2] = {{pidfd, POLLIN, 0}, {connection, POLLIN, 0}};
    while (::poll(watch, 2, -1) < 0 && errno == EINTR) {
    }
    if ((watch[0].revents & POLLIN) == 0) {
        ::syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0);  // the kernel left
    }
    siginfo_t info{};
    rusage usage{};
    while (::syscall(SYS_waitid, P_PIDFD, pidfd, &info, WEXITED, &usage) != 0 && errno == EINTR) {
    }
    const int status = info.si_code == CLD_EXITED ? (info.si_status << 8) : (info.si_status & 0x7f);
    const long long utime = usage.ru_utime.tv_sec * 1000000LL + usage.ru_utime.tv_usec;
    const long long stime = usage.ru_stime.tv_sec * 1000000LL + usage.ru_stime.tv_usec;
    send_json(connection, "{\"exit\": {\"status\": " + std::to_string(status) + ", \"utime_us\": " +
                              std::to_string(utime) + ", \"stime_us\": " + std::to_string(stime) +
                              ", \"maxrss_kib\": " + std::to_string(usage.ru_maxrss) + "}}");
    ::close(pidfd);
    return 1;
}

}  // namespace

// In the sanitizer build this program is instrumented: ASan's start-up would lower an exec'd probe's soft
// core limit and catch its signals (a fork does not run it again), so the comparison of both kinds of worker
// would see ASan, not the sandbox.
extern "C" const char* __asan_default_options() {
    return "disable_coredump=0:handle_segv=0:handle_sigbus=0:handle_sigfpe=0:handle_sigill=0:handle_abort=0";
}

int main(int argc, char** argv) {
    std::vector<std::string> args(argv + 1, argv + argc);
    if (args.size() == 1 && args[0] == "--probe") {
        return probe_report();
    }
    std::string library, socket_path, private_view;
    bool from_fds = false;
    for (std::size_t i = 0; i < args.size(); ++i) {
        if (args[i] == "--library" && i + 1 < args.size()) {
            library = args[++i];
        } else if (args[i] == "--socket" && i + 1 < args.size()) {
            socket_path = args[++i];
        } else if (args[i] == "--private-view" && i + 1 < args.size()) {
            private_view = args[++i];
        } else if (args[i] == "--from-fds") {
            from_fds = true;
        } else {
            std::cerr << "zygote_test_template: unknown argument " << args[i] << std::endl;
            return 2;
        }
    }
    View view;
    int listening = -1;
    if (from_fds) {
        const char* from_environment = std::getenv("CELLBLOCK_ZYGOTE_LIBRARY");
        library = from_environment ? from_environment : "";
        listening = 3;
        view.host_mount_ns = 4;
        view.own_mount_ns = ::open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
        view.own_cwd = ::open(".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (view.own_mount_ns < 0 || view.own_cwd < 0) {
            die("open my own view");
        }
    } else {
        if (library.empty() || socket_path.empty() || private_view.empty()) {
            std::cerr << "zygote_test_template: --library, --socket and --private-view are needed"
                      << std::endl;
            return 2;
        }
        view.host_mount_ns = ::open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
        if (view.host_mount_ns < 0 || ::unshare(CLONE_NEWNS) != 0 ||
            ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
            ::mount("tmpfs", private_view.c_str(), "tmpfs", 0, "size=64k") != 0 ||
            ::chdir(private_view.c_str()) != 0) {
            die("make a private view");
        }
        std::ofstream("marker") << "only the template sees this\n";
        view.marker = "marker";
        view.own_mount_ns = ::open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
        view.own_cwd = ::open(".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (view.own_mount_ns < 0 || view.own_cwd < 0) {
            die("open my own view");
        }
        listening = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        sockaddr_un address{};
        address.sun_family = AF_UNIX;
        std::strncpy(address.sun_path, socket_path.c_str(), sizeof address.sun_path - 1);
        if (listening < 0 || ::bind(listening, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
            ::chmod(socket_path.c_str(), 0600) != 0 || ::listen(listening, 16) != 0) {
            die("listen on " + socket_path);
        }
    }
    void* handle = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
        std::cerr << "zygote_test_template: dlopen " << library << ": " << ::dlerror() << std::endl;
        return 2;
    }
    auto spawn = reinterpret_cast<SpawnFunction>(::dlsym(handle, "cellblock_zygote_spawn"));
    if (spawn == nullptr) {
        std::cerr << "zygote_test_template: no cellblock_zygote_spawn in " << library << std::endl;
        return 2;
    }
    std::cout << "ready" << std::endl;
    for (;;) {
        const int connection = ::accept4(listening, nullptr, nullptr, SOCK_CLOEXEC);
        if (connection < 0) {
            if (errno == EINTR) {
                continue;
            }
            die("accept");
        }
        if (serve(connection, spawn, view) == 0) {
            // The fork, confined. _exit: in the sanitizer build LeakSanitizer's exit-time check cannot stop
            // the threads of a process in new namespaces and would turn the probe's status into 1.
            ::_exit(probe_report());
        }
        ::close(connection);
    }
}

#pragma once
// A PostgreSQL server of the test's own: initdb into a temporary directory, pg_ctl start on a free port with
// its socket in that directory, pg_ctl stop and removal at the end. Run as the `postgres` user when the test
// runs as root (the server refuses root). Missing binaries are a failure (install-deps.sh installs them).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace cellblock::test {

class TemporaryPostgres {
  public:
    TemporaryPostgres() {
        namespace fs = std::filesystem;
        for (const auto& version : fs::directory_iterator("/usr/lib/postgresql"))
            if (fs::exists(version.path() / "bin" / "initdb"))
                bin_ = version.path() / "bin";
        if (bin_.empty())
            throw std::runtime_error(
                "no /usr/lib/postgresql/*/bin/initdb: run share/scripts/install-deps.sh "
                "--with-test-tools (package postgresql)");
        std::string pattern = (fs::temp_directory_path() / "cb-pg-XXXXXX").string();
        if (!::mkdtemp(pattern.data()))
            throw std::runtime_error("mkdtemp failed");
        directory_ = pattern;
        as_user_ = ::geteuid() == 0 ? "runuser -u postgres -- " : "";
        if (::geteuid() == 0 && std::system(("chown postgres: '" + directory_.string() + "'").c_str()) != 0)
            throw std::runtime_error("cannot chown " + directory_.string() + " to postgres");
        port_ = free_port();
        const std::string log = (directory_ / "setup.log").string();
        run(as_user_ + "'" + (bin_ / "initdb").string() + "' --auth=trust -U cellblock -D '" +
                (directory_ / "data").string() + "' >'" + log + "' 2>&1",
            "initdb");
        run(as_user_ + "'" + (bin_ / "pg_ctl").string() + "' -D '" + (directory_ / "data").string() +
                "' -l '" + (directory_ / "server.log").string() + "' -o \"-p " + std::to_string(port_) +
                " -k " + directory_.string() + " -c listen_addresses=127.0.0.1\" -w start >>'" + log +
                "' 2>&1",
            "pg_ctl start");
        started_ = true;
    }
    ~TemporaryPostgres() {
        if (started_)
            std::system((as_user_ + "'" + (bin_ / "pg_ctl").string() + "' -D '" +
                         (directory_ / "data").string() + "' -m immediate -w stop >/dev/null 2>&1")
                            .c_str());
        std::error_code ignored;
        std::filesystem::remove_all(directory_, ignored);
    }
    TemporaryPostgres(const TemporaryPostgres&) = delete;
    TemporaryPostgres& operator=(const TemporaryPostgres&) = delete;

    std::string url(const std::string& database = "postgres") const {
        return "postgresql://cellblock@127.0.0.1:" + std::to_string(port_) + "/" + database;
    }
    int port() const { return port_; }
    // Runs `sql` with psql as the superuser (setting up foreign tables and the like).
    void psql(const std::string& sql, const std::string& database = "postgres") const {
        run("'" + (bin_ / "psql").string() + "' -q -v ON_ERROR_STOP=1 '" + url(database) + "' -c \"" + sql +
                "\" >/dev/null",
            "psql " + sql);
    }

  private:
    void run(const std::string& command, const std::string& what) const {
        if (std::system(command.c_str()) != 0) {
            std::ifstream log(directory_ / "setup.log");
            std::stringstream text;
            text << log.rdbuf();
            throw std::runtime_error(what + " failed: " + text.str());
        }
    }
    static int free_port() {
        const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in address{};
        address.sin_family = AF_INET;
        address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t length = sizeof address;
        if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
            if (fd >= 0)
                ::close(fd);
            throw std::runtime_error("cannot find a free port");
        }
        ::close(fd);
        return ntohs(address.sin_port);
    }

    std::filesystem::path bin_, directory_;
    std::string as_user_;
    int port_ = 0;
    bool started_ = false;
};

}  // namespace cellblock::test

/* Blocking TCP with deadlines (see net.h).  poll() before each read or
 * write, so a dead or hung peer turns into an error naming it, never a hang;
 * MSG_NOSIGNAL, so a closed peer is an error, not SIGPIPE. */
#include "net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tidal/util.h"

static void tune(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* small messages: no Nagle delay */
}

td_status td_net_listen(int port, int *fd_out)
{
    *fd_out = -1;
    int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int v6 = fd >= 0;
    if (!v6) fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return td_error_set(TD_ERR_IO, "rendezvous: socket(): %s", strerror(errno));
    int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc;
    if (v6) { /* both IPv4 and IPv6 peers on one socket */
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        struct sockaddr_in6 a = { .sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port), .sin6_addr = in6addr_any };
        rc = bind(fd, (struct sockaddr *)&a, sizeof a);
    } else {
        struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        rc = bind(fd, (struct sockaddr *)&a, sizeof a);
    }
    if (rc != 0) {
        int e = errno;
        close(fd);
        if (e == EADDRINUSE)
            return td_error_set(TD_ERR_IO, "rendezvous: port %d is already in use on rank 0's host (another job, or "
                                "a previous run still closing); set MASTER_PORT (or TD_RDV_PORT) to a free port", port);
        return td_error_set(TD_ERR_IO, "rendezvous: cannot bind port %d: %s", port, strerror(e));
    }
    if (listen(fd, 128) != 0) {
        int e = errno;
        close(fd);
        return td_error_set(TD_ERR_IO, "rendezvous: listen on port %d: %s", port, strerror(e));
    }
    *fd_out = fd;
    return TD_OK;
}

td_status td_net_accept(int listen_fd, int timeout_ms, int *fd_out)
{
    *fd_out = -1;
    struct pollfd p = { .fd = listen_fd, .events = POLLIN };
    int rc;
    do rc = poll(&p, 1, timeout_ms < 0 ? 0 : timeout_ms);
    while (rc < 0 && errno == EINTR);
    if (rc < 0) return td_error_set(TD_ERR_IO, "rendezvous: poll: %s", strerror(errno));
    if (rc == 0) return TD_OK;
    int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) return TD_OK;
        return td_error_set(TD_ERR_IO, "rendezvous: accept: %s", strerror(errno));
    }
    tune(fd);
    *fd_out = fd;
    return TD_OK;
}

/* 0 when connected before the deadline; else -1 with errno set. */
static int connect_within(int fd, const struct addrinfo *ai, double deadline)
{
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) return 0;
    if (errno != EINPROGRESS) return -1;
    struct pollfd p = { .fd = fd, .events = POLLOUT };
    int left = (int)(deadline - td_now_ms()), rc;
    do rc = poll(&p, 1, left > 0 ? left : 0);
    while (rc < 0 && errno == EINTR);
    if (rc == 0) {
        errno = ETIMEDOUT;
        return -1;
    }
    int err = 0;
    socklen_t len = sizeof err;
    if (rc < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return -1;
    if (err) {
        errno = err;
        return -1;
    }
    return 0;
}

td_status td_net_connect(const char *host, int port, int timeout_ms, int *fd_out)
{
    *fd_out = -1;
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    double deadline = td_now_ms() + timeout_ms;
    const char *last = "no answer";
    char why[128] = "";
    for (;;) {
        struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, *res = NULL;
        int g = getaddrinfo(host, service, &hints, &res);
        if (g == 0) {
            for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
                /* non-blocking: an unreachable host must not block past the deadline
                 * (send and recv poll first, so the socket stays non-blocking) */
                int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
                if (fd < 0) continue;
                if (connect_within(fd, ai, deadline) == 0) {
                    freeaddrinfo(res);
                    tune(fd);
                    *fd_out = fd;
                    return TD_OK;
                }
                snprintf(why, sizeof why, "%s", strerror(errno));
                last = why;
                close(fd);
            }
            freeaddrinfo(res);
        } else if (g != EAI_AGAIN) {
            return td_error_set(TD_ERR_IO, "rendezvous: cannot resolve MASTER_ADDR '%s': %s", host, gai_strerror(g));
        } else {
            last = gai_strerror(g);
        }
        if (td_now_ms() >= deadline)
            return td_error_set(TD_ERR_IO, "rendezvous: no rank 0 at %s:%d after %.1f s (%s); is rank 0 running, "
                                "and are MASTER_ADDR/MASTER_PORT the same on every rank?", host, port,
                                timeout_ms / 1000.0, last);
        td_sleep_us(50000); /* rank 0 may not be listening yet */
    }
}

/* Waits for fd to be ready for `events`; fails after timeout_ms without it. */
static td_status wait_ready(int fd, short events, int timeout_ms, const char *who, const char *doing, size_t left)
{
    struct pollfd p = { .fd = fd, .events = events };
    int rc;
    do rc = poll(&p, 1, timeout_ms);
    while (rc < 0 && errno == EINTR);
    if (rc < 0) return td_error_set(TD_ERR_IO, "%s %s: poll: %s", doing, who, strerror(errno));
    if (rc == 0)
        return td_error_set(TD_ERR_IO, "no progress %s %s for %.1f s (%zu bytes left): it may have died or hung; "
                            "raise the timeout (TD_COMM_TIMEOUT_MS) if ranks are only slow", doing, who,
                            timeout_ms / 1000.0, left);
    return TD_OK;
}

td_status td_net_send(int fd, const void *buf, size_t bytes, int timeout_ms, const char *who)
{
    const char *p = buf;
    while (bytes) {
        td_status st = wait_ready(fd, POLLOUT, timeout_ms, who, "sending to", bytes);
        if (st) return st;
        ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
            return td_error_set(TD_ERR_IO, "sending to %s: %s (it has exited or closed the job's connection)", who,
                                strerror(errno));
        }
        p += n;
        bytes -= (size_t)n;
    }
    return TD_OK;
}

td_status td_net_recv(int fd, void *buf, size_t bytes, int timeout_ms, const char *who)
{
    char *p = buf;
    while (bytes) {
        td_status st = wait_ready(fd, POLLIN, timeout_ms, who, "receiving from", bytes);
        if (st) return st;
        ssize_t n = recv(fd, p, bytes, MSG_DONTWAIT);
        if (n == 0)
            return td_error_set(TD_ERR_IO, "%s closed the job's connection with %zu bytes still expected: it exited "
                                "or failed (see its message)", who, bytes);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
            return td_error_set(TD_ERR_IO, "receiving from %s: %s", who, strerror(errno));
        }
        p += n;
        bytes -= (size_t)n;
    }
    return TD_OK;
}

td_status td_net_free_port(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return td_error_set(TD_ERR_IO, "socket(): %s", strerror(errno));
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = 0 };
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof a;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        int e = errno;
        close(fd);
        return td_error_set(TD_ERR_IO, "finding a free port: %s", strerror(e));
    }
    *port = ntohs(a.sin_port);
    close(fd);
    return TD_OK;
}

td_status td_net_peer_addr(int fd, char *buf, size_t buf_bytes, int *loopback)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    *loopback = 0;
    if (getpeername(fd, (struct sockaddr *)&ss, &len) != 0)
        return td_error_set(TD_ERR_IO, "the address of a peer: %s", strerror(errno));
    const void *a;
    if (ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)&ss;
        if (IN6_IS_ADDR_V4MAPPED(&s6->sin6_addr)) { /* a v4 peer on a dual-stack socket: print it as v4 */
            struct in_addr v4;
            memcpy(&v4, &s6->sin6_addr.s6_addr[12], 4);
            *loopback = (ntohl(v4.s_addr) >> 24) == 127;
            return inet_ntop(AF_INET, &v4, buf, (socklen_t)buf_bytes) ? TD_OK
                   : td_error_set(TD_ERR_IO, "inet_ntop: %s", strerror(errno));
        }
        *loopback = IN6_IS_ADDR_LOOPBACK(&s6->sin6_addr);
        a = &s6->sin6_addr;
    } else {
        const struct sockaddr_in *s4 = (const struct sockaddr_in *)&ss;
        *loopback = (ntohl(s4->sin_addr.s_addr) >> 24) == 127;
        a = &s4->sin_addr;
    }
    return inet_ntop(ss.ss_family, a, buf, (socklen_t)buf_bytes) ? TD_OK
           : td_error_set(TD_ERR_IO, "inet_ntop: %s", strerror(errno));
}

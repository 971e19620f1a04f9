/* Private: blocking TCP helpers with a deadline on every wait, for the
 * rendezvous and the CPU communicator.  A wait that sees no progress for
 * timeout_ms fails; a closed peer fails at once.  Messages name the peer
 * by `who` ("rank 2"). */
#ifndef TIDAL_DIST_NET_H
#define TIDAL_DIST_NET_H

#include <stddef.h>

#include "tidal/status.h"

/* Listens on port (all interfaces, SO_REUSEADDR). */
td_status td_net_listen(int port, int *fd_out);
/* Accepts one connection within timeout_ms; *fd_out = -1 on timeout. */
td_status td_net_accept(int listen_fd, int timeout_ms, int *fd_out);
/* Connects to host:port, retrying refused connections until timeout_ms. */
td_status td_net_connect(const char *host, int port, int timeout_ms, int *fd_out);
td_status td_net_send(int fd, const void *buf, size_t bytes, int timeout_ms, const char *who);
td_status td_net_recv(int fd, void *buf, size_t bytes, int timeout_ms, const char *who);
/* A port nobody listens on now (the kernel's pick). */
td_status td_net_free_port(int *port);
/* The peer's address of a connected socket, numeric; *loopback set when it
 * is this host's loopback (127.0.0.0/8, ::1, or IPv4 mapped into IPv6). */
td_status td_net_peer_addr(int fd, char *buf, size_t buf_bytes, int *loopback);

#endif

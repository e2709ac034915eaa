"""Every limit of the HTTP layer, named once, with its unit.

Code reads these as ``limits.NAME`` at the moment it needs them (never
``from .limits import NAME``), so a test can patch one with ``monkeypatch``.
"""

from __future__ import annotations

KIB = 1024
MIB = 1024 * KIB

# Workers and the queue in front of them (see server.py's theory of operation).
WORKERS = 32                  # requests served at once; each holds one from its whole head to its answer's end
ACCEPT_QUEUE = 64             # whole requests waiting for a worker; past it a new connection is closed at once
LISTEN_BACKLOG = 1024         # the kernel's accept backlog (capped by net.core.somaxconn): a burst of
                              # connections must not overflow it, or the kernel drops handshakes and a
                              # client waits a second for its retry
ACCEPT_RETRY_S = 0.1          # pause after accept() fails for lack of file descriptors

# Connections that hold no worker: waiting for a request, or for the rest of one (admission.py).
READERS = 512                 # such connections at once; past it the oldest idle one is closed for a new one
PEER_ARRIVING = 8             # of them, per peer address (an IPv6 /64 counts as one), left waiting for the
                              # rest of a request head (or of a refused body); the next one is closed at once

# Request size.
BODY_LIMIT_BYTES = 8 * MIB            # default body cap of a route: 413 past it
BIG_BODY_LIMIT_BYTES = 64 * MIB       # chat / messages / responses routes (images)
MAX_HEADER_BYTES = 64 * KIB           # a request head still incomplete past this: 431
DISCARD_BODY_BYTES = 64 * KIB         # body read and thrown away after a refusal, to keep the connection
PIPELINE_BUFFER_BYTES = 64 * KIB      # bytes of a pipelined next request buffered while a handler runs
RECV_BYTES = 64 * KIB                 # one receive_some() call
MAX_QUERY_FIELDS = 1000               # name=value pairs in a query string: 400 past it

# Time.
HEAD_TIMEOUT_S = 5.0          # a whole request head, from its first byte (408, then closed)
BODY_GRACE_S = 10.0           # a body's deadline: this, plus what its bytes so far earn at the floor rate,
BODY_FLOOR_BYTES_PER_S = 64 * KIB   # so at most BODY_GRACE_S + length / rate (408); 64 MiB: about 17 min
KEEPALIVE_IDLE_S = 30.0       # an idle connection, new or kept-alive, waiting for a request (holds no
                              # worker; closed sooner when its seat is taken back for a new connection)
WRITE_TIMEOUT_S = 5.0         # one write to a client; a reader that stops reading is dropped after it
LINGER_S = 2.0                # after refusing a request whose body is still arriving: drain, then close
LINGER_BYTES = 64 * MIB       # ... at most this much of it
PARENT_POLL_S = 1.0           # --parent-pid: how often the parent is looked for

# TCP keep-alive, set on the listening socket so that accepted sockets inherit it (Linux).
TCP_KEEPIDLE_S = 15           # idle time before the first probe
TCP_KEEPINTVL_S = 5           # between probes
TCP_KEEPCNT = 3               # unanswered probes before the connection is dropped
TCP_USER_TIMEOUT_S = 60       # data left unacknowledged this long drops the connection

# Routes that hold a worker for long (their limiters are built by the route owners).
EVENT_STREAMS = 8             # open GET /api/events streams: the next gets 503 streams_full
TURN_WAITING = 16             # chat / decide turns waiting behind the running one: the next gets 503 busy

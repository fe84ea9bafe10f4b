"""Carry the ranks' record files of every node to node 0, over TCP, with no shared filesystem.

In a multi-node script probe each node runs its own launcher (`distdoctor probe train.py --nnodes N
--node-rank R ...`), and its ranks write their records into that node's own run directory. Node 0
judges the whole job, so it needs every rank's records: node 0 listens beside the rendezvous (on
its port + 1, or `DISTDOCTOR_RELAY_PORT`), and every other node follows its run directory and sends
what its ranks append, line by line, while the job runs. Nothing goes through the training's
process group, so a desynchronised job is not made worse, and what a node sent before it died is
still judged: the records simply end where the node stopped.

Standard library only (the launcher never imports torch). The stream is one JSON object per line:
`{"node": R, "host": H, "file": "rank3.jsonl", "data": "..."}` for appended text, and
`{"node": R, "host": H, "done": true}` when that node's ranks have all exited.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

RELAY_PORT_ENV = "DISTDOCTOR_RELAY_PORT"
# The files of a run directory that travel: records (complete lines only) and stall stacks.
_PATTERNS = ("rank*.jsonl", "stacks*.txt")
_POLL_S = 0.2


def relay_address(rdzv_endpoint: str) -> tuple[str, int]:
    """Node 0's relay address: the rendezvous host, on the rendezvous port + 1 unless overridden."""
    host, _, port = rdzv_endpoint.rpartition(":")
    override = os.environ.get(RELAY_PORT_ENV)
    return host.strip("[]"), int(override) if override else int(port) + 1


@dataclass
class NodeState:
    """What node 0 heard from one other node."""

    host: str = ""
    done: bool = False
    last_heard: float = field(default_factory=time.monotonic)


class RelayServer:
    """Node 0's side: append what other nodes send to the files of the local run directory."""

    def __init__(self, run_dir: Path, port: int) -> None:
        self.run_dir = Path(run_dir)
        self.nodes: dict[int, NodeState] = {}
        self._lock = threading.Lock()
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for raw in self.rfile:
                    try:
                        message = json.loads(raw)
                    except ValueError:
                        continue
                    if isinstance(message, dict):
                        server._receive(message)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        try:
            self._server = Server(("", port), Handler)
        except OSError as exc:
            raise OSError(f"the probe's relay port {port} cannot be opened on node 0 ({exc.strerror}); "
                          f"set {RELAY_PORT_ENV} to a free port on every node") from None
        self.port = port
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def start(self) -> RelayServer:
        self._thread.start()
        return self

    def _receive(self, message: dict) -> None:
        node = message.get("node")
        if not isinstance(node, int):
            return
        with self._lock:
            state = self.nodes.setdefault(node, NodeState())
            state.host = str(message.get("host") or state.host)
            state.last_heard = time.monotonic()
            name = message.get("file")
            data = message.get("data")
            if isinstance(name, str) and isinstance(data, str) and _safe_name(name):
                with open(self.run_dir / name, "a", encoding="utf-8") as out:
                    out.write(data)
            if message.get("done"):
                state.done = True

    def wait_for(self, nnodes: int, timeout_s: float) -> list[int]:
        """Wait until every other node said it is done, at most `timeout_s`; the nodes still missing."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                missing = [node for node in range(1, nnodes) if not (node in self.nodes and self.nodes[node].done)]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(_POLL_S)

    def hosts(self) -> dict[int, str]:
        with self._lock:
            return {node: state.host for node, state in self.nodes.items()}

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a serving loop that was started
            self._server.shutdown()
        self._server.server_close()


def _safe_name(name: str) -> bool:
    """Only plain file names of the run directory's own kinds: never a path."""
    return "/" not in name and "\\" not in name and name not in ("", ".", "..") and name.endswith((".jsonl", ".txt"))


class RelayClient:
    """Node R's side: follow the local run directory and send what its ranks append to node 0."""

    def __init__(self, run_dir: Path, address: tuple[str, int], node_rank: int, *, connect_timeout_s: float = 10.0) -> None:
        self.run_dir = Path(run_dir)
        self.address = address
        self.node_rank = node_rank
        self.host = socket.gethostname()
        self.connect_timeout_s = connect_timeout_s
        self._offsets: dict[str, int] = {}
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.error = ""
        self.reached = False  # node 0's relay answered at least once during the run

    def start(self) -> RelayClient:
        self._thread.start()
        return self

    def _connect(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        try:
            self._sock = socket.create_connection(self.address, timeout=5.0)
        except OSError as exc:
            self.error = f"cannot reach node 0's relay at {self.address[0]}:{self.address[1]} ({exc})"
            return None
        self.error = ""
        self.reached = True
        return self._sock

    def _send(self, message: dict) -> bool:
        sock = self._connect()
        if sock is None:
            return False
        try:
            sock.sendall((json.dumps(message) + "\n").encode("utf-8"))
            return True
        except OSError as exc:
            self.error = f"lost node 0's relay at {self.address[0]}:{self.address[1]} ({exc})"
            sock.close()
            self._sock = None
            return False

    def _flush(self, *, final: bool) -> None:
        for pattern in _PATTERNS:
            for path in sorted(self.run_dir.glob(pattern)):
                offset = self._offsets.get(path.name, 0)
                try:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                except OSError:
                    continue
                if path.suffix == ".jsonl" and not final:
                    data = data[: data.rfind(b"\n") + 1]  # a line still being written waits
                if not data:
                    continue
                message = {"node": self.node_rank, "host": self.host, "file": path.name,
                           "data": data.decode("utf-8", errors="replace")}
                if self._send(message):
                    self._offsets[path.name] = offset + len(data)

    def _loop(self) -> None:
        while not self._stop.wait(_POLL_S):
            self._flush(final=False)

    def stop(self) -> str:
        """Send what is left and say this node is done; '' or why node 0 could not be told."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        # Keep trying for a while only if node 0 was reached during the run: a node that never
        # reached it (no rendezvous, wrong address) says so at once instead of waiting again.
        deadline = time.monotonic() + (self.connect_timeout_s if self.reached else 0.0)
        while True:
            self._flush(final=True)
            if not self.error and self._send({"node": self.node_rank, "host": self.host, "done": True}):
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        if self._sock is not None:
            self._sock.close()
        return self.error


# How long node 0 waits, after its own ranks exited, for the other nodes' last records.
FINAL_WAIT_S = 15.0


def start_relay(run_dir: Path, nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> RelayServer | RelayClient | None:
    """The relay this node runs for a multi-node script probe (None on one node)."""
    if nnodes <= 1 or rdzv_endpoint is None:
        return None
    host, port = relay_address(rdzv_endpoint)
    if node_rank == 0:
        return RelayServer(run_dir, port).start()
    return RelayClient(run_dir, (host, port), node_rank).start()


@dataclass(frozen=True)
class RelayOutcome:
    """What the relay did: on node 0, the nodes heard from and the nodes that never finished; on
    the others, where the records went and why they could not all be sent."""

    node_rank: int
    address: str
    hosts: dict[int, str]
    missing_nodes: tuple[int, ...] = ()
    error: str = ""


def finish_relay(relay: RelayServer | RelayClient, nnodes: int, node_rank: int) -> RelayOutcome:
    if isinstance(relay, RelayServer):
        missing = relay.wait_for(nnodes, FINAL_WAIT_S)
        hosts = relay.hosts()
        relay.stop()
        return RelayOutcome(node_rank, f":{relay.port}", hosts, tuple(missing))
    error = relay.stop()
    return RelayOutcome(node_rank, f"{relay.address[0]}:{relay.address[1]}", {node_rank: relay.host}, (), error)

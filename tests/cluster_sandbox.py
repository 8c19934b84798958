"""A two-host Ray cluster on one machine, for tests/test_cluster_netns.py.

Preferred: two network namespaces joined by a veth pair, node A at 10.231.0.1 (Ray's head, the
server) and node B at 10.231.0.2, a /24 that exists only inside the namespaces made here. Every
process of a node runs in its namespace (`ip netns exec`), so "every process of node B" is
`ip netns pids`, and the test's HTTP clients are threads that enter node A's namespace (setns).
Where namespaces cannot be made (not root, no CAP_NET_ADMIN, no `ip`), two Ray nodes on loopback
instead (node B's processes: the process tree of its `ray start --block`);
COVER_VLLM_TEST_LOOPBACK_CLUSTER=1 forces that variant.

Nothing here sends a packet outside the namespaces it made or 127.0.0.0/8. Ray is kept small (one
logical CPU and an 80 MB object store per node; token authentication with a token of its own),
and its memory monitor is off: it watches the whole host's memory, so on a shared machine another
job's use would make it kill this cluster's (small) workers.
`close` kills by pid everything it started and deletes the namespaces (never `ray stop`, which
would stop every Ray instance on the machine).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cover_vllm

SUBNET = "10.231.0"
OBJECT_STORE_BYTES = 80_000_000          # Ray's minimum is 75 MiB
CLONE_NEWNET = 0x40000000
REPO = Path(cover_vllm.__file__).resolve().parent.parent
NODES_SCRIPT = ("import json, ray; ray.init(address={!r}, configure_logging=False, "
                "log_to_driver=False); print(json.dumps([[n['NodeManagerAddress'], n['NodeID'], "
                "n['Alive'], 'node:__internal_head__' in n['Resources']] for n in ray.nodes()]))")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def netns_unavailable(probe: str) -> str | None:
    """Why network namespaces cannot be used here, else None (`probe`: a name to try)."""
    if os.environ.get("COVER_VLLM_TEST_LOOPBACK_CLUSTER") == "1":
        return "COVER_VLLM_TEST_LOOPBACK_CLUSTER=1"
    if os.geteuid() != 0:
        return "not root"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    except FileNotFoundError:
        return "no `ip` command"
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _enter_netns(name: str) -> None:
    """Move the calling thread into network namespace `name` (a thread pool's initializer)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _tree(root: int) -> list[int]:
    """`root` and every descendant (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


class Sandbox:
    def __init__(self, root: Path):
        tag = f"cv{os.getpid() % 100000}"
        self.names = [f"{tag}a", f"{tag}b"]
        self.reason = netns_unavailable(f"{tag}p")
        self.netns = self.reason is None
        self.hosts = [f"{SUBNET}.1", f"{SUBNET}.2"] if self.netns else ["127.0.0.1"] * 2
        self.ray_port = 6379 if self.netns else free_port()
        self.root = root
        (root / "token").write_text(os.urandom(32).hex())
        self._ray: list[subprocess.Popen | None] = [None, None]
        self._procs: list[subprocess.Popen] = []
        self.node_ids: list[str | None] = [None, None]
        self.servers = 0                         # ClusterServers started (their ports)
        if self.netns:
            try:
                self._make_namespaces()
            except BaseException:
                self._delete_namespaces()
                raise
        self.pool = ThreadPoolExecutor(16, initializer=_enter_netns if self.netns else None,
                                       initargs=(self.names[0],) if self.netns else ())

    @property
    def address(self) -> str:
        return f"{self.hosts[0]}:{self.ray_port}"

    def _make_namespaces(self) -> None:
        a, b = self.names
        for cmd in (["netns", "add", a], ["netns", "add", b],
                    ["link", "add", f"{a}0", "type", "veth", "peer", "name", f"{b}0"],
                    ["link", "set", f"{a}0", "netns", a], ["link", "set", f"{b}0", "netns", b],
                    ["-n", a, "addr", "add", f"{self.hosts[0]}/24", "dev", f"{a}0"],
                    ["-n", b, "addr", "add", f"{self.hosts[1]}/24", "dev", f"{b}0"],
                    ["-n", a, "link", "set", f"{a}0", "up"],
                    ["-n", b, "link", "set", f"{b}0", "up"],
                    ["-n", a, "link", "set", "lo", "up"], ["-n", b, "link", "set", "lo", "up"]):
            subprocess.run(["ip", *cmd], check=True, capture_output=True)

    def _delete_namespaces(self) -> None:
        for name in self.names:                 # their veth ends go with them
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    # ---- processes -------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
                   PYTHONPATH=str(REPO), RAY_AUTH_MODE="token",
                   RAY_AUTH_TOKEN_PATH=str(self.root / "token"), RAY_USAGE_STATS_ENABLED="0",
                   RAY_memory_monitor_refresh_ms="0")    # see the module docstring
        env.pop("RAY_ADDRESS", None)
        return env

    def popen(self, node: int, argv: list[str], log: str) -> subprocess.Popen:
        """Run `argv` as a process of `node` (in its namespace), output to root/`log`."""
        prefix = ["ip", "netns", "exec", self.names[node]] if self.netns else []
        with open(self.root / log, "ab") as out:
            proc = subprocess.Popen(prefix + argv, env=self.env(), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self._procs.append(proc)
        return proc

    def run(self, node: int, argv: list[str], timeout_s: float) -> str:
        """Run `argv` on `node` to the end; its stdout (RuntimeError with its output if it
        fails)."""
        prefix = ["ip", "netns", "exec", self.names[node]] if self.netns else []
        done = subprocess.run(prefix + argv, env=self.env(), capture_output=True, text=True,
                              timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{argv} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done.stdout

    def start_ray(self, node: int) -> None:
        argv = [str(Path(sys.executable).parent / "ray"), "start", "--block",
                "--node-ip-address", self.hosts[node], "--num-cpus", "1",
                "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"]
        if node == 0:
            argv += ["--head", "--port", str(self.ray_port), "--include-dashboard", "false",
                     "--temp-dir", str(self.root / "ray")]
        else:
            argv += ["--address", self.address]
        if not self.netns:                        # two nodes share the host's ports
            for flag in ("--node-manager-port", "--object-manager-port",
                         "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                         "--runtime-env-agent-port", "--metrics-export-port"):
                argv += [flag, str(free_port())]
        self._ray[node] = self.popen(node, argv, f"ray-{node}.log")

    def nodes(self) -> list[tuple[str, str, bool, bool]]:
        """(ip, node id, alive, head) of every node the cluster knows."""
        out = self.run(0, [sys.executable, "-c", NODES_SCRIPT.format(self.address)], 120)
        return [tuple(n) for n in json.loads(out.strip().splitlines()[-1])]

    def wait_nodes(self, alive: int, timeout_s: float = 120.0, gone: str | None = None) -> None:
        """Until exactly `alive` nodes are alive, node `gone` not among them; records node A's
        and B's ids."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                nodes = [n for n in self.nodes() if n[2]]
            except (RuntimeError, subprocess.TimeoutExpired):
                nodes = []                           # the head is still starting
            if len(nodes) == alive and gone not in [n[1] for n in nodes]:
                break
            assert time.monotonic() < deadline, f"cluster nodes: {nodes}"
        for ip, node_id, _, head in nodes:
            self.node_ids[0 if head else 1] = node_id

    def pids(self, node: int) -> list[int]:
        """Every process of `node`."""
        if self.netns:
            out = subprocess.run(["ip", "netns", "pids", self.names[node]], capture_output=True,
                                 text=True).stdout
            return [int(p) for p in out.split()]
        proc = self._ray[node]
        return _tree(proc.pid) if proc is not None else []

    def signal(self, node: int, sig: int) -> int:
        """Send `sig` to every process of `node`; how many got it."""
        sent = 0
        for pid in self.pids(node):
            try:
                os.kill(pid, sig)
                sent += 1
            except ProcessLookupError:
                pass
        return sent

    def restart_node_b(self) -> None:
        """Node B anew (its old processes killed); returns once the cluster has declared the
        old one dead, so that exactly A and the new B are alive."""
        self.signal(1, signal.SIGKILL)
        self.start_ray(1)
        self.wait_nodes(2, timeout_s=180.0, gone=self.node_ids[1])

    # ---- the client side (threads in node A's namespace) -----------------------------------
    def call(self, fn, *args):
        """fn(*args) on a client thread (one in node A's namespace)."""
        return self.pool.submit(fn, *args).result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for node in (1, 0):
            pids = self.pids(node)
            for sig in (signal.SIGCONT, signal.SIGKILL):
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        if self.netns:
            self._delete_namespaces()


class ClusterServer:
    """`cover-vllm serve` as a process of node A, on the sandbox's cluster."""

    def __init__(self, sandbox: Sandbox, log: str, *flags: str):
        self.sandbox, self.log_path = sandbox, sandbox.root / log
        port = free_port() if not sandbox.netns else 8000 + sandbox.servers
        sandbox.servers += 1                    # a server never answers for another
        self.url = f"http://{sandbox.hosts[0]}:{port}"
        self.proc = sandbox.popen(0, [sys.executable, "-m", "cover_vllm", "serve", "cover-tiny",
                                      "--ray-address", sandbox.address, "--host",
                                      sandbox.hosts[0], "--port", str(port), "--threads", "1",
                                      *flags], log)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"the server exited:\n{self.log()[-4000:]}"
            try:
                if self.sandbox.call(httpx.get, self.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the server is not up:\n{self.log()[-4000:]}"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)     # uvicorn's graceful shutdown
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

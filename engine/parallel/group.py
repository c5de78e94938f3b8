"""Ranks, their gloo group, and the step channel that carries rank 0's records to the others.

Two connections join the ranks of one engine:

* the **collective group**: Paddle's ``ProcessGroupGloo`` (``paddle.base.core``), rendezvoused
  through Paddle's ``TCPStore``, as ``paddle.distributed.init_parallel_env`` builds its default
  group when ``PADDLE_DISTRI_BACKEND=gloo`` (``python/paddle/distributed/parallel.py``: the store
  at ``MASTER_ADDR:MASTER_PORT``, else ``PADDLE_MASTER``, else the first of
  ``PADDLE_TRAINER_ENDPOINTS``; ``PADDLE_TRAINER_ID`` / ``PADDLE_TRAINERS_NUM`` give rank and
  size). The group is built directly rather than by ``init_parallel_env`` so that one process
  can start, stop and start again an engine's group (``init_parallel_env`` makes one default
  group per process, for its life) and so that the store lives where its port is released
  when the engine stops (below). The layers call `CollectiveGroup.all_reduce` /
  ``gather``, which time themselves: that time is the step's communication.
* the **step channel**: one TCP connection from each rank to rank 0 (`Channel`:
  length-prefixed pickles), on which rank 0 sends each step's `StepRecord` and commands
  and a rank reports a failure. A rank blocks on it between steps, so an idle engine has no
  collective waiting to time out, and a rank whose rank 0 is gone reads end-of-file and exits.

Ports, on one machine (`start_local_ranks`): rank 0 listens for the channel on
``127.0.0.1:<free port>``; the ``TCPStore`` server is hosted by rank 1 on another free port
(Paddle's store server keeps its port open for the life of the process that hosts it, so it
lives in a rank that the engine stops); gloo's own connections between ranks use ephemeral
ports. All are closed when the engine stops or a rank dies.
"""

from __future__ import annotations

import hmac
import os
import pickle
import secrets
import socket
import struct
import subprocess
import sys
import threading
import time

ENV_CHANNEL = "ENGINE_TP_CHANNEL"          # host:port of rank 0's step channel
ENV_TOKEN = "ENGINE_TP_TOKEN"              # the secret a rank proves itself with on the channel
ENV_STORE_HOST_RANK = "ENGINE_TP_STORE_RANK"  # which rank hosts the TCPStore server (default 0)
STORE_TIMEOUT_S = 120                      # rendezvous: how long a rank waits for the others
_HEADER = struct.Struct("!Q")


class RankFailure(RuntimeError):
    """A rank died or failed; the tensor-parallel group cannot run another step."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Channel:
    """Pickled messages over one TCP connection, each prefixed by its length."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, address: str, timeout: float = 60.0) -> "Channel":
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
                sock.settimeout(None)
                return cls(sock)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self, timeout: float | None = None):
        """The next message; EOFError when the other side closed, TimeoutError after ``timeout`` s."""
        self.sock.settimeout(timeout)
        try:
            (size,) = _HEADER.unpack(self._read(_HEADER.size))
            self.sock.settimeout(None)  # once a message has started, read all of it
            return pickle.loads(self._read(size))
        except socket.timeout:
            raise TimeoutError("no message") from None
        finally:
            self.sock.settimeout(None)

    def _read(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(min(left, 1 << 20))
            if not chunk:
                raise EOFError("the channel was closed")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


_next_gid = iter(range(1000, 1 << 30))
_live_groups: set[int] = set()


def next_group_id() -> int:
    """A process-group id not used before in this process (Paddle keeps its groups in one map by id;
    every rank of a group must use the same id: its rendezvous keys start with it)."""
    return next(_next_gid)


class CollectiveGroup:
    """This rank's gloo process group, and the seconds spent in its collectives (``comm_s``)."""

    def __init__(self, rank: int, world: int, store_address: str, store_rank: int = 0,
                 timeout_s: int = STORE_TIMEOUT_S, gid: int | None = None):
        from paddle.base import core

        self.rank, self.world = rank, world
        host, port = store_address.rsplit(":", 1)
        # ProcessGroup reads the global rank from the environment (process_group.cc).
        saved = os.environ.get("PADDLE_TRAINER_ID")
        os.environ["PADDLE_TRAINER_ID"] = str(rank)
        try:
            self.store = core.TCPStore(host, int(port), rank == store_rank, world, timeout_s)
            self.gid = next_group_id() if gid is None else gid
            self.pg = core.ProcessGroupGloo.create(self.store, rank, world, self.gid)
        finally:
            if saved is None:
                os.environ.pop("PADDLE_TRAINER_ID", None)
            else:
                os.environ["PADDLE_TRAINER_ID"] = saved
        _live_groups.add(self.gid)
        self._sum = core.ReduceOp.SUM
        self.comm_s, self.calls = 0.0, 0

    def all_reduce(self, tensor):
        """Sum ``tensor`` over the ranks, in place; returns it."""
        t0 = time.perf_counter()
        self.pg.all_reduce(tensor, self._sum, True).wait()
        self.comm_s += time.perf_counter() - t0
        self.calls += 1
        return tensor

    def all_gather(self, tensor):
        """``[world, *tensor.shape]``: every rank's ``tensor``, in rank order."""
        import paddle

        t0 = time.perf_counter()
        out = paddle.empty([self.world * tensor.shape[0]] + list(tensor.shape[1:]), dtype=tensor.dtype)
        self.pg.all_gather_into_tensor(out, tensor, True).wait()
        self.comm_s += time.perf_counter() - t0
        self.calls += 1
        return out.reshape([self.world] + list(tensor.shape))

    def gather(self, tensor, root: int = 0):
        """``[world, *tensor.shape]`` on rank ``root``: every rank's ``tensor``, in rank order; None on the
        others (half the bytes of an all-gather at two ranks: only ``root`` receives)."""
        import paddle

        t0 = time.perf_counter()
        out = paddle.empty([self.world * tensor.shape[0]] + list(tensor.shape[1:]), dtype=tensor.dtype)
        self.pg.gather(tensor, out, root, True).wait()
        self.comm_s += time.perf_counter() - t0
        self.calls += 1
        return out.reshape([self.world] + list(tensor.shape)) if self.rank == root else None

    def close(self) -> None:
        """Drop the group: Paddle keeps every process group in one map by id until it is cleared,
        which clears all of them, so that happens when this process's last group closes."""
        from paddle.base import core

        if self.gid not in _live_groups:
            return
        _live_groups.discard(self.gid)
        self.pg = None
        if not _live_groups:
            core.ProcessGroupIdMap.destroy()
        self.store = None


def _python_path() -> str:
    """The directory holding the ``engine`` package first, so a rank imports this same code."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + rest if rest else "")


class Ranks:
    """Ranks 1..N-1 as rank 0 sees them: a `Channel` to each (accepted on ``listener``, each rank
    proving itself with ``token``), and the process of each where rank 0 started it."""

    def __init__(self, world: int, token: str, listener: socket.socket, store_address: str, store_rank: int):
        self.world, self.token, self.listener = world, token, listener
        self.channel_address = "%s:%d" % listener.getsockname()[:2]
        self.store_address, self.store_rank = store_address, store_rank
        self.procs: dict[int, subprocess.Popen] = {}
        self.channels: dict[int, Channel] = {}

    @staticmethod
    def listen(host: str, port: int, backlog: int) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(backlog)
        return listener

    def accept(self, timeout_s: float) -> None:
        """Wait for every rank's channel; stop everything rank 0 started if one never comes."""
        try:
            self._accept(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _accept(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self.listener.settimeout(0.5)
        while len(self.channels) < self.world - 1:
            self.check_alive()
            if time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel ranks {sorted(set(range(1, self.world)) - set(self.channels))} did not "
                                  f"connect to rank 0 within {timeout_s:.0f} s")
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                continue
            sock.settimeout(None)
            channel = Channel(sock)
            try:
                hello = channel.recv(timeout=30)
            except (EOFError, TimeoutError, OSError, pickle.UnpicklingError):
                channel.close()
                continue
            rank, token = hello if isinstance(hello, tuple) and len(hello) == 2 else (None, "")
            if (not (isinstance(token, str) and hmac.compare_digest(token, self.token))
                    or rank not in range(1, self.world) or rank in self.channels):
                channel.close()
                continue
            self.channels[rank] = channel
        self.listener.close()

    def dead(self) -> dict[int, int]:
        """Ranks whose process has exited, with their exit codes (negative: the signal)."""
        return {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}

    def check_alive(self) -> None:
        dead = self.dead()
        if dead:
            raise RankFailure(describe_exits(dead))

    def send_all(self, message) -> None:
        for rank, channel in self.channels.items():
            try:
                channel.send(message)
            except OSError as exc:
                raise RankFailure(f"tensor-parallel rank {rank} cannot be reached: {exc}") from exc

    def gather_reports(self, timeout: float) -> dict[int, object]:
        """What each rank says next (a reply to a command), ``timeout`` seconds at most in all."""
        deadline = time.monotonic() + timeout
        replies = {}
        for rank, channel in self.channels.items():
            while True:
                try:
                    replies[rank] = channel.recv(timeout=0.5)
                    break
                except TimeoutError:
                    self.check_alive()
                    if time.monotonic() > deadline:
                        raise RankFailure(f"tensor-parallel rank {rank} did not answer within {timeout:.0f} s")
                except (EOFError, OSError):
                    time.sleep(0.2)
                    raise RankFailure(describe_exits(self.dead()) or f"tensor-parallel rank {rank} closed its "
                                                                     f"channel") from None
        return replies

    def errors(self, wait: float = 0.0) -> dict[int, str]:
        """Failure reports the ranks sent (``("error", text)``), waiting up to ``wait`` s for them."""
        found = {}
        deadline = time.monotonic() + wait
        for rank, channel in self.channels.items():
            try:
                message = channel.recv(timeout=max(deadline - time.monotonic(), 0.01))
            except (TimeoutError, EOFError, OSError, pickle.UnpicklingError):
                continue
            if isinstance(message, tuple) and message and message[0] == "error":
                found[rank] = message[1]
        return found

    def stop(self, grace_s: float = 2.0) -> None:
        """Close the channels (a rank between steps exits on end-of-file), then end any rank still
        running: SIGTERM, and SIGKILL after ``grace_s``."""
        for channel in self.channels.values():
            channel.close()
        self.channels = {}
        try:
            self.listener.close()
        except OSError:
            pass
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class LocalRanks(Ranks):
    """Ranks 1..N-1 on this machine: fresh interpreters running ``python -m engine.parallel.worker``
    (as a spawn start does, but without re-running the caller's main module) with the trainer
    environment, on 127.0.0.1. Rank 1 hosts the store, so its port closes when the ranks stop."""

    def __init__(self, world: int, start_timeout_s: float = 300.0):
        super().__init__(world, secrets.token_hex(16), self.listen("127.0.0.1", 0, world),
                         "127.0.0.1:%d" % free_port(), 1)
        from ..config import usable_cores

        threads = str(max(1, usable_cores() // world))
        for rank in range(1, world):
            env = dict(os.environ)
            env.update({
                "PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(world),
                "PADDLE_MASTER": self.store_address, "PADDLE_DISTRI_BACKEND": "gloo",
                ENV_STORE_HOST_RANK: str(self.store_rank), ENV_CHANNEL: self.channel_address,
                ENV_TOKEN: self.token, "PYTHONPATH": _python_path(),
                "OMP_NUM_THREADS": threads, "NUMBA_NUM_THREADS": threads,
            })
            env.setdefault("GLOG_minloglevel", "2")  # Paddle's C++ INFO lines (store, gloo) stay quiet
            env.pop("MASTER_ADDR", None)
            env.pop("MASTER_PORT", None)
            self.procs[rank] = subprocess.Popen([sys.executable, "-m", "engine.parallel.worker"], env=env,
                                                stdin=subprocess.DEVNULL)
        self.accept(start_timeout_s)


def launched() -> bool:
    """This process is rank 0 of ranks started by someone else (``paddle.distributed.launch`` or a
    script setting its environment): ``PADDLE_TRAINER_ID=0`` and ``ENGINE_TP_CHANNEL`` are set."""
    return os.environ.get("PADDLE_TRAINER_ID") == "0" and bool(os.environ.get(ENV_CHANNEL))


class LaunchedRanks(Ranks):
    """Ranks 1..N-1 started elsewhere (other machines), each running ``python -m engine.parallel.worker``
    with the same environment: rank 0 listens on ``ENGINE_TP_CHANNEL`` and hosts the store at
    ``MASTER_ADDR:MASTER_PORT`` (or ``PADDLE_MASTER``, or the first ``PADDLE_TRAINER_ENDPOINTS``)
    unless ``ENGINE_TP_STORE_RANK`` names another rank. Rank 0 has no handle on their processes:
    a rank that dies shows as its closed channel or a failing collective."""

    def __init__(self, world: int, start_timeout_s: float = 600.0):
        from .worker import store_address

        size = int(os.environ.get("PADDLE_TRAINERS_NUM", "0"))
        if size != world:
            raise ValueError(f"tensor_parallel_size={world} but PADDLE_TRAINERS_NUM={size}: the launcher started "
                             f"{size} ranks")
        token = os.environ.get(ENV_TOKEN, "")
        if not token:
            raise ValueError(f"{ENV_TOKEN} must be set (the same secret on every rank) when the ranks are launched")
        host, port = os.environ[ENV_CHANNEL].rsplit(":", 1)
        super().__init__(world, token, self.listen(host, int(port), world), store_address(),
                         int(os.environ.get(ENV_STORE_HOST_RANK, "0")))
        self.accept(start_timeout_s)


def describe_exits(dead: dict[int, int]) -> str:
    if not dead:
        return ""
    import signal

    parts = []
    for rank, code in sorted(dead.items()):
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        parts.append(f"tensor-parallel rank {rank} {how}")
    return "; ".join(parts)

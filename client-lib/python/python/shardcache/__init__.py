"""Read training data through the node-local NVMe cache (``shardcached``).

``shardcache.open(path)`` returns a binary file object that reads the node's local
copy of ``path`` and falls back to the shared file system whenever the cache cannot
help (no daemon, a file outside the cached roots, a full cache): a cache problem never
fails a read. ``ShuffleSampler`` / ``DistributedShuffleSampler`` give PyTorch-style
index orders computed by the same Rust code as the daemon's planner, and tell the
daemon the plan so that it prefetches and keeps what the job reads next.
``make_manifest`` builds a prefetch manifest (docs/MANIFEST.md) from a directory, a
glob or a list of paths. See docs/PYTHON.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import time
import warnings
import weakref
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Union

from . import _shardcache as _native
from ._shardcache import ManifestError, node_order, rank_order, samples_per_rank

__version__ = _native.__version__
SHUFFLE_ALGORITHM: str = _native.shuffle_algorithm()

__all__ = [
    "Client",
    "CacheFile",
    "DistributedShuffleSampler",
    "ManifestError",
    "ShuffleSampler",
    "SHUFFLE_ALGORITHM",
    "default_client",
    "default_job_id",
    "make_manifest",
    "node_order",
    "open",
    "rank_order",
    "samples_per_rank",
]

PathLike = Union[str, "os.PathLike[str]"]

_builtin_open = open  # this module's ``open`` reads through the cache

_lock = threading.Lock()
_default: Optional["Client"] = None
_default_pid = -1


def default_client() -> "Client":
    """This process's default client, what :func:`open` uses (a new one after ``fork``:
    connections are not shared between processes, so a ``DataLoader`` worker gets its
    own)."""
    return _default_client()


def _default_client() -> "Client":
    """The process's default client (a new one after ``fork``: connections are not
    shared between processes)."""
    global _default, _default_pid
    pid = os.getpid()
    with _lock:
        if _default is None or _default_pid != pid:
            _default = Client()
            _default_pid = pid
        return _default


class CacheFile(io.RawIOBase):
    """An unbuffered, read-only binary file over a cached file.

    Made by :func:`open` (usually wrapped in an ``io.BufferedReader``). Reads go to the
    node-local copy, or to the shared file system for whatever the cache cannot serve.
    ``fileno()`` is not supported: the local copy is the daemon's, and may be missing
    blocks that this object fetches on demand.
    """

    def __init__(self, reader: Any, name: str) -> None:
        super().__init__()
        self._r = reader
        self._pos = 0
        self.name = name

    @property
    def mode(self) -> str:
        return "rb"

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        """The file's size in bytes (of the version being read)."""
        return self._r.size()

    @property
    def source(self) -> str:
        """``"cache"`` or ``"backing"`` (see :meth:`fallback_reason`)."""
        return self._r.source()

    def fallback_reason(self) -> Optional[str]:
        """Why the shared file system was read, if it was."""
        return self._r.fallback_reason()

    def stats(self) -> dict:
        """Bytes and reads by source, and seconds spent waiting, so far."""
        return self._r.stats()

    def local_path(self) -> Optional[str]:
        """Where the node-local copy is, once the daemon holds every byte (None if it
        cannot): for inspection and benchmarks, since the daemon may evict it any time."""
        p = self._r.local_path()
        return None if p is None else os.fspath(p)

    def readinto(self, b: Any) -> int:
        self._checkClosed()
        n = self._r.readinto_at(b, self._pos)
        self._pos += n
        return n

    def readall(self) -> bytes:
        self._checkClosed()
        data = self._r.read_to_end(self._pos)
        self._pos += len(data)
        return data

    def read(self, size: Optional[int] = -1) -> bytes:
        self._checkClosed()
        if size is None or size < 0:
            return self.readall()
        data = self._r.read_at(size, self._pos)
        self._pos += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._r.size() + offset
        else:
            raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
        if pos < 0:
            raise OSError(22, "negative seek position")
        self._pos = pos
        return pos

    def tell(self) -> int:
        self._checkClosed()
        return self._pos

    def fileno(self) -> int:
        raise io.UnsupportedOperation(
            "shardcache files have no descriptor of their own; use builtins.open, "
            "or the LD_PRELOAD shim, where a descriptor is needed"
        )

    def close(self) -> None:
        if not self.closed:
            self._r = _Closed()
        super().close()


class _Closed:
    def __getattr__(self, _name: str) -> Any:
        raise ValueError("I/O operation on closed file")


def _wrap(reader: Any, name: str, buffering: int = -1) -> Any:
    raw = CacheFile(reader, name)
    if buffering == 0:
        return raw
    return io.BufferedReader(raw, buffer_size=buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE)


def open(  # noqa: A001 - mirrors builtins.open on purpose
    path: PathLike,
    mode: str = "rb",
    buffering: int = -1,
    encoding: Optional[str] = None,
    errors: Optional[str] = None,
    newline: Optional[str] = None,
    *,
    client: Optional["Client"] = None,
) -> Any:
    """Opens ``path`` for reading through the cache.

    ``mode`` is ``"rb"`` (a binary file object: ``io.BufferedReader``, or the raw
    :class:`CacheFile` with ``buffering=0``) or ``"r"`` (text, through
    ``io.TextIOWrapper`` with ``encoding``, ``errors`` and ``newline``). Works the same
    with no daemon running: the file is then read from the shared file system. Raises
    what ``builtins.open`` raises when the file itself cannot be opened (e.g.
    ``FileNotFoundError``).
    """
    m = mode.replace("t", "")
    binary = "b" in m
    if sorted(m.replace("b", "")) != ["r"] or ("t" in mode and binary):
        raise ValueError(
            f"shardcache.open reads only (mode {mode!r}); use builtins.open to write"
        )
    if binary and (encoding or errors or newline is not None):
        raise ValueError("binary mode takes no encoding, errors or newline")
    if buffering == 0 and not binary:
        raise ValueError("can't have unbuffered text I/O")
    c = client if client is not None else _default_client()
    name = os.fspath(path)
    f = _wrap(c._native.open(name), name, buffering)
    if binary:
        return f
    return io.TextIOWrapper(f, encoding=encoding, errors=errors, newline=newline)


class Client:
    """A handle on the node's daemon.

    ``socket`` defaults to ``$SHARDCACHE_SOCKET``, else the packaged default;
    ``timeout`` (seconds) bounds each exchange with the daemon, ``wait_timeout`` a wait
    for a block to be fetched. Constructing one never fails; without a daemon, reads
    fall back to the shared file system and the planning calls raise ``OSError``.
    """

    def __init__(
        self,
        socket: Optional[PathLike] = None,
        timeout: Optional[float] = None,
        wait_timeout: Optional[float] = None,
    ) -> None:
        self._native = _native.NativeClient(
            os.fspath(socket) if socket is not None else None, timeout, wait_timeout
        )

    @property
    def socket(self) -> str:
        return os.fspath(self._native.socket())

    def open(self, path: PathLike, mode: str = "rb", buffering: int = -1, **kw: Any) -> Any:
        """As :func:`shardcache.open`, through this client."""
        return open(path, mode, buffering, client=self, **kw)

    def open_many(self, paths: Iterable[PathLike], buffering: int = -1) -> list:
        """Opens many files (binary) with one exchange with the daemon per 64 files:
        for loaders that fetch a batch at once (e.g. a ``Dataset.__getitems__``). Raises
        the first error, as opening them one by one would."""
        names = [os.fspath(p) for p in paths]
        out = []
        for name, r in zip(names, self._native.open_many(names)):
            if isinstance(r, BaseException):
                raise r
            out.append(_wrap(r, name, buffering))
        return out

    def open_ahead(self, paths: Iterable[PathLike], batch: int = 32, buffering: int = -1) -> Iterator[Any]:
        """Yields binary file objects for ``paths`` in order while the daemon opens the
        next ``batch`` (≤ 64) files: the exchange with the daemon leaves the critical
        path of loaders that know their order (a sampler's epoch). An error is raised
        when its file's turn comes."""
        names = [os.fspath(p) for p in paths]
        for name, r in zip(names, self._native.open_ahead(names, batch)):
            yield _wrap(r, name, buffering)

    def register(self, manifest: Union[Mapping[str, Any], str]) -> tuple:
        """Registers a prefetch manifest (a dict as :func:`make_manifest` builds, or
        JSON text); returns ``(job, files)``. Raises :class:`ManifestError` naming the
        field when the daemon refuses it, ``OSError`` when no daemon answers."""
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return tuple(self._native.register(text))

    def register_leased(self, manifest: Union[Mapping[str, Any], str], lease: float = 60.0) -> tuple:
        """As :meth:`register`, with a lease of ``lease`` seconds: the daemon keeps the
        job while this process is alive or while it is renewed within the lease (a
        :meth:`progress` call, a read of one of its files, a registration again), and
        unregisters it otherwise. This process becomes one of the job's holders
        (:meth:`release`). See docs/MANIFEST.md, "Leases"."""
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return tuple(self._native.register(text, float(lease)))

    def unregister(self, job: str) -> bool:
        """Forgets a job, whoever holds it; True if it was registered."""
        return self._native.unregister(job)

    def release(self, job: str) -> bool:
        """This process stops holding leased job ``job``: the daemon removes only this
        process's hold while other processes (other ranks on this node) hold the job,
        else the job. True if it was registered."""
        return self._native.unregister(job, True)

    def progress(self, job: str, epoch: int, step: int = 0) -> bool:
        """Tells the daemon that ``job`` is about to read step ``step`` of ``epoch``
        (this renews a lease); True if the job is registered (False: never registered,
        its lease ran out, or the daemon restarted; register it again). Reads through the
        cache move the position too."""
        return self._native.progress(job, epoch, step)

    def status(self) -> dict:
        """The daemon's status as plain data (what ``shardcache status --json`` prints)."""
        return json.loads(self._native.status_json())


def _relative(root: str, p: str) -> str:
    if os.path.isabs(p):
        rel = os.path.relpath(p, root)
        if rel == os.curdir or rel.startswith(os.pardir + os.sep) or rel == os.pardir:
            raise ManifestError(f"files: {p} is not under root {root}")
        return rel.replace(os.sep, "/")
    return p.replace(os.sep, "/")


def _walk(root: str) -> list:
    out = []
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for f in files:
            full = os.path.join(d, f)
            if os.path.isfile(full) and not os.path.islink(full):
                out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    out.sort()
    return out


def make_manifest(
    job: str,
    root: PathLike,
    files: Optional[Union[Iterable[PathLike], str]] = None,
    *,
    glob: Optional[str] = None,
    seed: int = 0,
    epochs: int = 1,
    world_size: int = 1,
    ranks: Sequence[int] = (0,),
    drop_last: bool = False,
    first_epoch: int = 0,
    order: Optional[Sequence[Sequence[Union[int, str]]]] = None,
    immutable: bool = False,
    sizes: Union[bool, Sequence[int]] = False,
) -> dict:
    """Builds a prefetch manifest (docs/MANIFEST.md) and checks it as the daemon will.

    The files are ``files`` (paths absolute under ``root`` or relative to it, in the
    order that numbers them), else those matching ``glob`` (``*``, ``?``, ``**``,
    relative to ``root``), else every regular file under ``root``; the last two are
    listed here, sorted, so that the manifest and any sampler built from the same list
    agree on numbering. The plan is a shuffle (``seed``, ``epochs``, ``world_size``,
    this node's ``ranks``, ``drop_last``) unless ``order`` gives each epoch's sequence
    of file indices or paths. ``sizes=True`` records each file's size (one ``stat``
    each), or ``sizes`` gives them (bytes, one per file, in order): with every size
    given, the daemons' cluster placement counts bytes, not files (docs/MANIFEST.md).
    Raises :class:`ManifestError` naming the field.
    """
    root_s = os.path.abspath(os.fspath(root))
    if files is not None and glob is not None:
        raise ManifestError("files: give a list or a glob, not both")
    if isinstance(files, str):
        raise ManifestError("files: give a list of paths (a string is one path)")
    if files is not None:
        names = [_relative(root_s, os.fspath(f)) for f in files]
    elif glob is not None:
        import glob as _glob

        names = sorted(
            os.path.relpath(p, root_s).replace(os.sep, "/")
            for p in _glob.glob(os.path.join(root_s, glob), recursive=True)
            if os.path.isfile(p) and not os.path.islink(p)
        )
        if not names:
            raise ManifestError(f"files.glob: {glob!r} matches no regular file under {root_s}")
    else:
        names = _walk(root_s)
    listed: list = names
    if sizes is True:
        listed = [{"path": n, "size": os.path.getsize(os.path.join(root_s, n))} for n in names]
    elif sizes is not False and sizes is not None:
        given = [int(x) for x in sizes]
        if len(given) != len(names):
            raise ManifestError(f"files: {len(given)} sizes for {len(names)} files")
        if any(x < 0 for x in given):
            raise ManifestError("files: a size is negative")
        listed = [{"path": n, "size": x} for n, x in zip(names, given)]
    if order is not None:
        plan: dict = {"kind": "sequence", "epochs": [list(e) for e in order]}
    else:
        plan = {
            "kind": "shuffle",
            "algorithm": SHUFFLE_ALGORITHM,
            "seed": int(seed),
            "epochs": int(epochs),
            "world_size": int(world_size),
            "ranks": [int(r) for r in ranks],
            "drop_last": bool(drop_last),
        }
    if first_epoch:
        plan["first_epoch"] = int(first_epoch)
    m = {
        "version": 1,
        "job": job,
        "root": root_s,
        "files": listed,
        "immutable": bool(immutable),
        "plan": plan,
    }
    _native.check_manifest(json.dumps(m))
    return m


def _process_start() -> str:
    """This process's start time (clock ticks since boot, from /proc), else the time
    this module was imported: with the pid, unique to this process on this node."""
    try:
        with _builtin_open(f"/proc/{os.getpid()}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return repr(_IMPORTED)


_IMPORTED = time.time()


def _run_identity() -> str:
    """What every rank of one run shares and other runs do not: torchrun's rendezvous
    id (``TORCHELASTIC_RUN_ID`` unless ``none``), else the rendezvous address
    (``MASTER_ADDR:MASTER_PORT``), plus Slurm's job and step ids when set. With none of
    them (a single process) this process's pid and start time."""
    env = os.environ
    parts = []
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        parts.append(f"run={run_id}")
    elif env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        parts.append(f"master={env['MASTER_ADDR']}:{env['MASTER_PORT']}")
    for k in ("SLURM_JOB_ID", "SLURM_STEP_ID"):
        if env.get(k):
            parts.append(f"{k}={env[k]}")
    if not parts:
        parts.append(f"pid={os.getpid()}:{_process_start()}")
    return ";".join(parts)


def default_job_id(root: PathLike, seed: int) -> str:
    """The job id a sampler registers under by default: the dataset root's basename and
    a short hash of the real (symlinks resolved) root, the seed and the run's identity
    (:func:`_run_identity`: torchrun's run id or rendezvous address, Slurm's job and
    step ids), so that every rank of one run gets the same id and other runs and
    datasets other ids. Never the rank."""
    real = os.path.realpath(os.fspath(root))
    base = os.path.basename(real.rstrip(os.sep)) or "dataset"
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in base)[:64]
    h = hashlib.sha256(f"{real}\0{int(seed)}\0{_run_identity()}".encode()).hexdigest()[:12]
    return f"{safe}.{h}"


def _release(client: "Client", job: str, pid: int) -> None:
    """A sampler's hold on its job, let go at exit (in the process that registered it
    only: a forked worker inherits the finalizer but not the hold)."""
    if os.getpid() != pid:
        return
    try:
        client.release(job)
    except Exception:  # noqa: BLE001 - at exit, a daemon gone is no error: the lease ends it
        pass


def _world() -> tuple:
    """(world size, rank) from torch.distributed when it is initialised, else from the
    WORLD_SIZE / RANK environment variables, else (1, 0). Imports torch only if it is
    already imported or installed."""
    try:
        import torch.distributed as dist  # type: ignore[import-not-found]

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


class DistributedShuffleSampler:
    """Like ``torch.utils.data.DistributedSampler(shuffle=True)``: each epoch a seeded
    shuffle of ``range(n)``, padded (or cut, with ``drop_last``) to a multiple of the
    world and sliced for this rank — computed by the same Rust code as the daemon's
    planner (``pcg64-fisher-yates/v1``), so that the two always agree.

    ``dataset`` gives ``n = len(dataset)`` (or pass ``n``). With ``files`` (the file of
    each index, absolute paths), the sampler registers the plan with the daemon on the
    first ``set_epoch`` or iteration, as job ``job`` (default: :func:`default_job_id`,
    the same on every rank of one run, different across runs and datasets), and
    reports each new epoch; the daemon then prefetches the files this rank reads next
    and keeps what it reads soonest. Ranks of one run on one node add to one node plan.
    ``sizes`` (each file's size in bytes, in the order of ``files``; or ``True``: the
    sampler stats every file once, when it first registers) goes into the plan: with
    peers, the nodes then place the cluster's copies by bytes, not by files, which
    keeps placement at its floor when sizes spread (docs/MANIFEST.md).

    The registration has a lease of ``lease`` seconds (docs/MANIFEST.md, "Leases"): the
    daemon keeps the job while this process lives, or while the job's reads and the
    sampler's reports at each ``set_epoch`` renew it, and drops it otherwise (a job
    that died leaves nothing prefetching). At a clean exit the sampler lets go of the
    job (the daemon drops it once no rank on the node holds it); when the daemon no
    longer knows the job (it restarted, or the lease ran out in a long pause) the next
    ``set_epoch`` registers it again. The daemon being absent or slow never stops the
    sampler (a warning is issued once).

    Compatible with PyTorch's sampler protocol (``__iter__``, ``__len__``,
    ``set_epoch``); torch itself is not needed.
    """

    def __init__(
        self,
        dataset: Any = None,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        n: Optional[int] = None,
        files: Optional[Sequence[PathLike]] = None,
        job: Optional[str] = None,
        epochs: int = 1000,
        client: Optional[Client] = None,
        lease: float = 60.0,
        sizes: Union[bool, Sequence[int], None] = None,
    ) -> None:
        if not shuffle:
            raise ValueError("DistributedShuffleSampler always shuffles (shuffle=False is not supported)")
        if n is None:
            if dataset is None:
                raise ValueError("give a dataset or n")
            n = len(dataset)
        if files is not None and len(files) != n:
            raise ValueError(f"files lists {len(files)} paths for {n} samples")
        if num_replicas is None or rank is None:
            w, r = _world()
            num_replicas = w if num_replicas is None else num_replicas
            rank = r if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside a world of {num_replicas}")
        self.n = int(n)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.epochs = int(epochs)
        self._files = [os.path.abspath(os.fspath(f)) for f in files] if files is not None else None
        if sizes is not None and sizes is not True and sizes is not False:
            sizes = [int(x) for x in sizes]
            if self._files is None or len(sizes) != len(self._files):
                raise ValueError(f"sizes gives {len(sizes)} sizes for {n} files")
        self._sizes: Union[bool, list, None] = sizes
        self._client = client
        self.lease = float(lease)
        self._registered: Optional[tuple] = None  # (first epoch, last epoch + 1)
        self._finalizer: Optional[weakref.finalize] = None
        self._warned = False
        # Decided now, in the process that made the sampler (from its environment).
        if job is None and self._files is not None:
            job = default_job_id(self._root(), self.seed)
        self._job = job

    def _root(self) -> str:
        assert self._files is not None
        return os.path.commonpath(self._files) if len(self._files) > 1 else os.path.dirname(self._files[0])

    @property
    def job(self) -> Optional[str]:
        """The job id the plan is registered under (None without ``files``)."""
        return self._job if self._files is not None else None

    def __getstate__(self) -> dict:
        # A copy (pickled to another process) holds nothing until it registers itself.
        d = self.__dict__.copy()
        d["_finalizer"] = None
        d["_registered"] = None
        return d

    def close(self) -> None:
        """Lets go of the job now (as at exit): the daemon drops it once no other
        process holds it."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._registered = None

    def __len__(self) -> int:
        return samples_per_rank(self.n, self.num_replicas, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        self._tell_daemon()
        return iter(rank_order(self.n, self.seed, self.epoch, self.num_replicas, self.rank, self.drop_last))

    def order(self, epoch: Optional[int] = None) -> list:
        """This rank's indices for ``epoch`` (default: the current one)."""
        e = self.epoch if epoch is None else epoch
        return rank_order(self.n, self.seed, e, self.num_replicas, self.rank, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch (the shuffle depends on it) and tells the daemon."""
        self.epoch = int(epoch)
        self._tell_daemon()

    def _sizes_(self) -> Union[bool, list]:
        """The files' sizes for the plan (stat once, when asked to), else False."""
        if self._sizes is True:
            assert self._files is not None
            self._sizes = [os.path.getsize(f) for f in self._files]
        return self._sizes if isinstance(self._sizes, list) else False

    def _client_(self) -> Client:
        return self._client if self._client is not None else _default_client()

    def _tell_daemon(self) -> None:
        if self._files is None:
            return
        try:
            c = self._client_()
            reg = self._registered
            # The report at every epoch guards against partial epochs, and renews the
            # lease; a job the daemon does not know (restarted, or the lease ran out)
            # is registered again.
            if reg is not None and reg[0] <= self.epoch < reg[1] and c.progress(self.job, self.epoch, 0):
                return
            m = make_manifest(
                self.job,
                self._root(),
                self._files,
                seed=self.seed,
                epochs=self.epochs,
                world_size=self.num_replicas,
                ranks=[self.rank],
                drop_last=self.drop_last,
                first_epoch=self.epoch,
                immutable=True,
                sizes=self._sizes_(),
            )
            if self.lease > 0:
                c.register_leased(m, self.lease)
                if self._finalizer is None:
                    self._finalizer = weakref.finalize(self, _release, c, self.job, os.getpid())
            else:
                c.register(m)
            self._registered = (self.epoch, self.epoch + self.epochs)
        except OSError as e:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"shardcache: could not tell the daemon the plan ({e}); reads still work",
                    RuntimeWarning,
                    stacklevel=3,
                )


class ShuffleSampler(DistributedShuffleSampler):
    """A :class:`DistributedShuffleSampler` for one process (world of 1)."""

    def __init__(self, dataset: Any = None, seed: int = 0, **kw: Any) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, seed=seed, **kw)

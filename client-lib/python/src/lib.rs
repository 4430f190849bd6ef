//! `shardcache._shardcache`: the native half of the `shardcache` Python package, a thin
//! layer over the Rust client library (`shardcache_client`) and the shared shuffle
//! (`shardcache_plan::shuffle`). The Python half (`python/shardcache/`) builds the
//! file objects, samplers and manifest helpers on top; see docs/PYTHON.md.
//!
//! I/O runs with the GIL released, so loader threads read in parallel.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use shardcache_client::{Client, ClientConfig, Reader, Source};
use shardcache_plan::shuffle;

pyo3::create_exception!(
    _shardcache,
    ManifestError,
    PyValueError,
    "A manifest (or a plan position) the daemon refused: the message names the field."
);

/// An open file: reads the node-local copy, falling back to the backing store.
#[pyclass(module = "shardcache._shardcache", name = "Reader", frozen)]
struct PyReader {
    inner: Reader,
}

fn closed_after<T>(r: io::Result<T>) -> PyResult<T> {
    r.map_err(PyErr::from)
}

/// Reads `len` bytes at `offset` into `dst` (fewer only at the end of the file).
fn fill(r: &Reader, dst: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < dst.len() {
        let n = r.read_at(&mut dst[done..], offset + done as u64)?;
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(done)
}

/// Reads up to `len` bytes at `offset` into a new `bytes` object: made uninitialised and
/// read straight into (a zeroed one, as `PyBytes::new_with` makes, costs a memset; a
/// buffer copied into it, a copy), with the GIL released during the read.
fn read_bytes<'py>(
    py: Python<'py>,
    r: &Reader,
    len: usize,
    offset: u64,
) -> PyResult<Bound<'py, PyBytes>> {
    // SAFETY: PyBytes_FromStringAndSize(NULL, len) returns a new, uniquely owned bytes
    // object of `len` uninitialised bytes (or NULL with an exception set, which
    // from_owned_ptr_or_err turns into an error); nothing else can see it until we
    // return it, so writing its contents here is allowed.
    let obj = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), len as pyo3::ffi::Py_ssize_t),
        )?
    };
    // SAFETY: `obj` is the bytes object just created; PyBytes_AsString gives its buffer
    // of `len` bytes.
    let ptr = unsafe { pyo3::ffi::PyBytes_AsString(obj.as_ptr()) } as usize;
    let n = py.detach(|| {
        // SAFETY: the buffer is `len` bytes, owned by `obj` (alive for this call), and
        // nobody else holds a reference to `obj` yet.
        let dst = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
        fill(r, dst, offset)
    });
    let n = closed_after(n)?;
    let obj = obj.cast_into::<PyBytes>()?;
    if n < len {
        // The file ended early (it shrank under a reader of the backing store).
        return Ok(PyBytes::new(py, &obj.as_bytes()[..n]));
    }
    Ok(obj)
}

#[pymethods]
impl PyReader {
    /// Size of the file (of the version being read), in bytes.
    fn size(&self) -> u64 {
        self.inner.len()
    }

    /// `"cache"` when the daemon serves the file (blocks it could not supply are read
    /// from the backing store), `"backing"` when it is read from the backing store only.
    fn source(&self) -> &'static str {
        match self.inner.source() {
            Source::Cache => "cache",
            _ => "backing",
        }
    }

    /// Why the backing store was read, if it was.
    fn fallback_reason(&self) -> Option<String> {
        self.inner.fallback_reason()
    }

    /// Reads up to `size` bytes at `offset` (fewer only at the end of the file).
    fn read_at<'py>(
        &self,
        py: Python<'py>,
        size: usize,
        offset: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let size = size.min(self.inner.len().saturating_sub(offset) as usize);
        read_bytes(py, &self.inner, size, offset)
    }

    /// Reads into a writable, C-contiguous buffer at `offset`; returns the bytes read.
    fn readinto_at(
        &self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        offset: u64,
    ) -> PyResult<usize> {
        let buf = PyBuffer::<u8>::get(buffer)?;
        if buf.readonly() || !buf.is_c_contiguous() {
            return Err(PyValueError::new_err(
                "readinto needs a writable, contiguous buffer",
            ));
        }
        let (ptr, len) = (buf.buf_ptr() as usize, buf.len_bytes());
        let n = py.detach(|| {
            // SAFETY: `buf` keeps the exporter's memory alive and its length fixed for
            // as long as it is held (until after this closure); the memory is writable
            // and contiguous (checked above). Other Python threads may touch it
            // meanwhile, as they may while io.FileIO.readinto runs: bytes, no invariants.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
            fill(&self.inner, dst, offset)
        });
        drop(buf);
        closed_after(n)
    }

    /// Reads from `offset` to the end of the file into a new `bytes` object (one
    /// allocation of the exact size, no copy).
    fn read_to_end<'py>(&self, py: Python<'py>, offset: u64) -> PyResult<Bound<'py, PyBytes>> {
        let len = self.inner.len().saturating_sub(offset) as usize;
        read_bytes(py, &self.inner, len, offset)
    }

    /// The path of the node-local copy holding every byte of the file, after waiting
    /// for the daemon to fetch what is missing; None when the cache cannot provide one.
    /// For inspection and benchmarks: read through this object, not that path (the
    /// daemon may evict and replace it at any time).
    fn local_path(&self, py: Python<'_>) -> Option<PathBuf> {
        py.detach(|| {
            use std::os::fd::AsRawFd;
            let f = self.inner.local_copy()?;
            std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd())).ok()
        })
    }

    /// Bytes and reads so far by source, and seconds spent waiting.
    fn stats(&self) -> std::collections::HashMap<&'static str, f64> {
        let s = self.inner.stats();
        [
            ("hit_bytes", s.hit_bytes as f64),
            ("filled_bytes", s.filled_bytes as f64),
            ("fallback_bytes", s.fallback_bytes as f64),
            ("hit_reads", s.hit_reads as f64),
            ("filled_reads", s.filled_reads as f64),
            ("fallback_reads", s.fallback_reads as f64),
            ("wait_seconds", s.wait_time.as_secs_f64()),
            ("fallback_seconds", s.fallback_time.as_secs_f64()),
        ]
        .into_iter()
        .collect()
    }
}

/// A handle on the node's daemon. Never fails to construct: without a daemon, files are
/// read from the backing store and the planning calls raise `OSError`.
#[pyclass(module = "shardcache._shardcache", name = "NativeClient", frozen)]
struct PyClient {
    inner: Client,
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (socket=None, timeout=None, wait_timeout=None))]
    fn new(
        socket: Option<PathBuf>,
        timeout: Option<f64>,
        wait_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let mut cfg = ClientConfig::default();
        if let Some(s) = socket {
            cfg.socket = s;
        }
        let secs = |what: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(PyValueError::new_err(format!(
                    "{what} must be a positive number of seconds"
                )))
            }
        };
        if let Some(t) = timeout {
            cfg.timeout = secs("timeout", t)?;
        }
        if let Some(t) = wait_timeout {
            cfg.wait_timeout = secs("wait_timeout", t)?;
        }
        Ok(Self {
            inner: Client::with_config(cfg),
        })
    }

    /// The socket this client talks to.
    fn socket(&self) -> PathBuf {
        self.inner.config().socket.clone()
    }

    /// Opens `path` for reading (the local copy, else the backing store). Raises
    /// `OSError` only when the backing store itself cannot open the file.
    fn open(&self, py: Python<'_>, path: PathBuf) -> PyResult<PyReader> {
        let r = py.detach(|| self.inner.open(&path));
        Ok(PyReader {
            inner: closed_after(r)?,
        })
    }

    /// Opens many files in one exchange with the daemon per 64; each item is what
    /// `open` gives for that path, or the exception (an `OSError` instance) it raises.
    fn open_many(&self, py: Python<'_>, paths: Vec<PathBuf>) -> PyResult<Vec<Py<PyAny>>> {
        let rs = py.detach(|| self.inner.open_many(&paths));
        rs.into_iter()
            .map(|r| match r {
                Ok(inner) => Ok(Py::new(py, PyReader { inner })?.into_any()),
                Err(e) => Ok(PyErr::from(e).into_value(py).into_any()),
            })
            .collect()
    }

    /// Opens `paths` in order, one batch ahead of the caller: the daemon opens the next
    /// batch while the caller reads the current one.
    #[pyo3(signature = (paths, batch=32))]
    fn open_ahead(&self, paths: Vec<PathBuf>, batch: usize) -> PyOpenAhead {
        PyOpenAhead {
            inner: std::sync::Mutex::new(self.inner.open_ahead(paths, batch.clamp(1, 64))),
        }
    }

    /// Registers a manifest (JSON text), with a lease of `lease_s` seconds when not 0
    /// (this process then holds the job); returns (job id, number of files).
    #[pyo3(signature = (manifest_json, lease_s=0.0))]
    fn register(
        &self,
        py: Python<'_>,
        manifest_json: &str,
        lease_s: f64,
    ) -> PyResult<(String, u64)> {
        let r = py.detach(|| {
            if lease_s > 0.0 {
                let lease = std::time::Duration::from_secs_f64(lease_s.ceil().min(u32::MAX as f64));
                self.inner.register_leased(manifest_json, lease)
            } else {
                self.inner.register(manifest_json)
            }
        });
        match r {
            Ok(r) => Ok((r.job, r.files)),
            Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                Err(ManifestError::new_err(e.to_string()))
            }
            Err(e) => Err(PyOSError::new_err(format!("shardcached: {e}"))),
        }
    }

    /// Forgets a job; True if it was registered. With `holder`, only this process's
    /// hold on a leased job goes (the job stays while other processes hold it).
    #[pyo3(signature = (job, holder=false))]
    fn unregister(&self, py: Python<'_>, job: &str, holder: bool) -> PyResult<bool> {
        py.detach(|| {
            if holder {
                self.inner.release(job)
            } else {
                self.inner.unregister(job)
            }
        })
        .map_err(|e| PyOSError::new_err(format!("shardcached: {e}")))
    }

    /// Tells the daemon where a job is; True if the job is registered.
    fn progress(&self, py: Python<'_>, job: &str, epoch: u64, step: u64) -> PyResult<bool> {
        py.detach(|| self.inner.progress(job, epoch, step))
            .map_err(|e| {
                if e.to_string().contains("progress:") {
                    ManifestError::new_err(e.to_string())
                } else {
                    PyOSError::new_err(format!("shardcached: {e}"))
                }
            })
    }

    /// The daemon's status as JSON text.
    fn status_json(&self, py: Python<'_>) -> PyResult<String> {
        let s = py
            .detach(|| self.inner.status())
            .map_err(|e| PyOSError::new_err(format!("shardcached: {e}")))?;
        // The protocol's message, whose field names are the JSON's (docs/PYTHON.md).
        serde_json::to_string(&shardcache_client::proto::StatusReply::from(s))
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }
}

/// The iterator `NativeClient.open_ahead` returns: one `Reader` per path, in order.
#[pyclass(module = "shardcache._shardcache", name = "OpenAhead", frozen)]
struct PyOpenAhead {
    inner: std::sync::Mutex<shardcache_client::OpenAhead>,
}

#[pymethods]
impl PyOpenAhead {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> Option<PyResult<PyReader>> {
        let next = py.detach(|| self.inner.lock().unwrap_or_else(|e| e.into_inner()).next())?;
        Some(next.map(|inner| PyReader { inner }).map_err(PyErr::from))
    }
}

fn check_world(world: u64, ranks: &[u64]) -> PyResult<()> {
    if world == 0 {
        return Err(PyValueError::new_err("world_size must be at least 1"));
    }
    if let Some(r) = ranks.iter().find(|&&r| r >= world) {
        return Err(PyValueError::new_err(format!(
            "rank {r} is outside a world of {world}"
        )));
    }
    Ok(())
}

/// The order in which `rank` of `world` reads `n` samples in `epoch`
/// (`pcg64-fisher-yates/v1` with DistributedSampler slicing).
#[pyfunction]
#[pyo3(signature = (n, seed, epoch, world=1, rank=0, drop_last=false))]
fn rank_order(
    n: u64,
    seed: u64,
    epoch: u64,
    world: u64,
    rank: u64,
    drop_last: bool,
) -> PyResult<Vec<u64>> {
    check_world(world, &[rank])?;
    Ok(shuffle::rank_order(n, seed, epoch, world, rank, drop_last))
}

/// The order in which a node running `ranks` of `world` reads, ranks interleaved step
/// by step (what the daemon plans for a node).
#[pyfunction]
#[pyo3(signature = (n, seed, epoch, world, ranks, drop_last=false))]
fn node_order(
    n: u64,
    seed: u64,
    epoch: u64,
    world: u64,
    ranks: Vec<u64>,
    drop_last: bool,
) -> PyResult<Vec<u64>> {
    check_world(world, &ranks)?;
    if ranks.is_empty() {
        return Err(PyValueError::new_err("ranks must not be empty"));
    }
    Ok(shuffle::node_order(
        n, seed, epoch, world, &ranks, drop_last,
    ))
}

/// Samples per rank per epoch.
#[pyfunction]
#[pyo3(signature = (n, world=1, drop_last=false))]
fn samples_per_rank(n: u64, world: u64, drop_last: bool) -> PyResult<u64> {
    check_world(world, &[])?;
    Ok(shuffle::samples_per_rank(n, world, drop_last))
}

/// Checks a manifest (JSON text) the way the daemon will; raises ManifestError naming
/// the field.
#[pyfunction]
fn check_manifest(manifest_json: &str) -> PyResult<()> {
    shardcache_plan::manifest::Manifest::from_json(manifest_json)
        .map(|_| ())
        .map_err(|e| ManifestError::new_err(e.to_string()))
}

/// The shuffle algorithm's name, as manifests spell it.
#[pyfunction]
fn shuffle_algorithm() -> &'static str {
    shuffle::PCG64_FISHER_YATES_V1
}

#[pymodule]
fn _shardcache(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyReader>()?;
    m.add_class::<PyClient>()?;
    m.add_class::<PyOpenAhead>()?;
    m.add_function(wrap_pyfunction!(rank_order, m)?)?;
    m.add_function(wrap_pyfunction!(node_order, m)?)?;
    m.add_function(wrap_pyfunction!(samples_per_rank, m)?)?;
    m.add_function(wrap_pyfunction!(check_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(shuffle_algorithm, m)?)?;
    m.add("ManifestError", m.py().get_type::<ManifestError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

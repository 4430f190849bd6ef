//! Fault injection and observation for tests, as a wrapper: a [`FaultySource`] counts
//! the fetches that reach it and, on demand, fails them, answers "not here" or declines,
//! without a test-only field in any production type.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::{BlockRequest, BlockSource, Fetched, SourceError};

/// Counters and switches of a [`FaultySource`].
#[derive(Debug, Default)]
pub struct SourceFaults {
    /// Fetches that reached the wrapper.
    pub fetches: AtomicU64,
    /// Fail every fetch with an I/O error.
    pub fail: AtomicBool,
    /// Answer every fetch with [`Fetched::Miss`].
    pub miss: AtomicBool,
    /// Answer every fetch with [`Fetched::Declined`].
    pub decline: AtomicBool,
}

/// Wraps a source, counting fetches and changing their answers when told to.
#[derive(Debug)]
pub struct FaultySource {
    inner: Arc<dyn BlockSource>,
    faults: Arc<SourceFaults>,
}

impl FaultySource {
    /// `inner`, behind switches that start off.
    pub fn new(inner: Arc<dyn BlockSource>) -> (Self, Arc<SourceFaults>) {
        let faults = Arc::new(SourceFaults::default());
        (
            Self {
                inner,
                faults: faults.clone(),
            },
            faults,
        )
    }
}

impl BlockSource for FaultySource {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn remote(&self) -> bool {
        self.inner.remote()
    }

    fn fetch(&self, req: &BlockRequest<'_>, buf: &mut Vec<u8>) -> Result<Fetched, SourceError> {
        let f = &self.faults;
        f.fetches.fetch_add(1, Ordering::Relaxed);
        if f.fail.load(Ordering::Relaxed) {
            return Err(SourceError::Read(io::Error::other("injected fault")));
        }
        if f.miss.load(Ordering::Relaxed) {
            return Ok(Fetched::Miss);
        }
        if f.decline.load(Ordering::Relaxed) {
            return Ok(Fetched::Declined);
        }
        self.inner.fetch(req, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::Target;
    use crate::blocks::conformance::{self, SourceFixture};
    use crate::blocks::mem::MemSource;

    struct Fx {
        mem: Arc<MemSource>,
        faulty: FaultySource,
        next: AtomicU64,
        current: parking_lot::Mutex<std::collections::HashMap<String, crate::store::Key>>,
    }

    impl SourceFixture for Fx {
        fn source(&self) -> &dyn BlockSource {
            &self.faulty
        }
        fn root(&self) -> &str {
            "/r"
        }
        fn put(&self, path: &str, data: &[u8]) -> Arc<Target> {
            let t =
                conformance::target(path, data.len(), self.next.fetch_add(1, Ordering::Relaxed));
            // A new version replaces the one before it.
            let old = self.current.lock().insert(path.to_owned(), t.key);
            if let Some(old) = old {
                self.mem.remove(&old);
            }
            self.mem.insert(t.key, data.to_vec());
            t
        }
    }

    fn fx() -> (Fx, Arc<SourceFaults>) {
        let mem = Arc::new(MemSource::new(true));
        let (faulty, faults) = FaultySource::new(mem.clone());
        let fx = Fx {
            mem,
            faulty,
            next: AtomicU64::new(1),
            current: Default::default(),
        };
        (fx, faults)
    }

    #[test]
    fn conformance_with_no_fault_set() {
        conformance::sources(&|| fx().0);
    }

    #[test]
    fn faults_change_the_answer_and_every_fetch_is_counted() {
        let (fx, faults) = fx();
        let t = fx.put("f", &[7u8; 100]);
        let req = conformance::request(&t, "/r", 0, 100);
        let mut buf = Vec::new();
        assert!(matches!(
            fx.faulty.fetch(&req, &mut buf),
            Ok(Fetched::Got { .. })
        ));
        faults.decline.store(true, Ordering::Relaxed);
        assert!(matches!(
            fx.faulty.fetch(&req, &mut buf),
            Ok(Fetched::Declined)
        ));
        faults.miss.store(true, Ordering::Relaxed);
        assert!(matches!(fx.faulty.fetch(&req, &mut buf), Ok(Fetched::Miss)));
        faults.fail.store(true, Ordering::Relaxed);
        assert!(fx.faulty.fetch(&req, &mut buf).is_err());
        assert_eq!(faults.fetches.load(Ordering::Relaxed), 4);
        assert_eq!(fx.mem.fetches(), 1, "only the first reached the source");
    }
}

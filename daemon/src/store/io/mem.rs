//! The in-memory twin: data files as byte vectors in a map, with the same results as
//! the real engines (holes read as zeros, reads past the end fail, removal forgets).
//! The conformance suite holds psync and io_uring to it; it has no descriptors to hand
//! to clients, so the store itself always runs over a real engine.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;

use super::{BlockIo, Read, Write};

/// Data files in memory.
#[derive(Debug, Default)]
pub struct MemIo {
    files: Mutex<HashMap<String, Vec<u8>>>,
}

impl MemIo {
    /// An empty data directory.
    pub fn new() -> Self {
        Self::default()
    }

    fn files(&self) -> parking_lot::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.files.lock()
    }
}

fn not_found(name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{name}: no such data file"),
    )
}

impl BlockIo for MemIo {
    fn engine(&self) -> &'static str {
        "mem"
    }

    fn create(&self, name: &str, size: u64) -> io::Result<()> {
        self.files().insert(name.to_owned(), vec![0; size as usize]);
        Ok(())
    }

    fn write_durable(&self, name: &str, writes: &[Write<'_>]) -> io::Result<()> {
        let mut files = self.files();
        let f = files.get_mut(name).ok_or_else(|| not_found(name))?;
        for (off, data) in writes {
            let end = *off as usize + data.len();
            if f.len() < end {
                f.resize(end, 0);
            }
            f[*off as usize..end].copy_from_slice(data);
        }
        Ok(())
    }

    fn read_many(&self, name: &str, reads: &mut [Read<'_>]) -> Vec<io::Result<()>> {
        let files = self.files();
        let Some(f) = files.get(name) else {
            return reads.iter().map(|_| Err(not_found(name))).collect();
        };
        reads
            .iter_mut()
            .map(|(off, buf)| {
                let start = *off as usize;
                let end = start + buf.len();
                if end > f.len() {
                    return Err(super::eof());
                }
                buf.copy_from_slice(&f[start..end]);
                Ok(())
            })
            .collect()
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        self.files()
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| not_found(name))
    }

    fn exists(&self, name: &str) -> bool {
        self.files().contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::sync::Arc;

    #[test]
    fn conformance() {
        super::super::conformance::run_all(&|_: &Path| -> Arc<dyn BlockIo> {
            Arc::new(MemIo::new())
        });
    }
}

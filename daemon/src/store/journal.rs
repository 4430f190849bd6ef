//! The index journal: an append-only file of [`Record`]s that, replayed, rebuilds which
//! blocks of which file versions the store holds.
//!
//! Layout: the 8-byte magic `SCJRNL01`, then frames of a little-endian `u32` payload
//! length, a little-endian `u64` xxh3 of the payload, and the payload (a prost-encoded
//! [`Record`]). Replay stops at the first frame that is short or fails its checksum: that
//! is a write torn by a crash, and everything before it is intact.
//!
//! Appends go through one writer thread that batches whatever is queued into one
//! `write` and one `fdatasync` (group commit); [`Journal::append`] returns only once its
//! record is durable. A caller makes a block visible only after that, and writes the
//! block's data durably before appending, so a replayed record never points at data that
//! did not reach the disk.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use prost::Message;
use shardcache_proto::store::v1::Record;
use xxhash_rust::xxh3::xxh3_64;

const MAGIC: &[u8; 8] = b"SCJRNL01";
const MAX_RECORD: usize = 1 << 20;
/// Most records one group commit takes.
const MAX_BATCH: usize = 1024;

type Done = SyncSender<Result<(), Arc<io::Error>>>;
/// A framed record and where to report its durability.
type Pending = (Vec<u8>, Done);

/// An open journal accepting appends.
#[derive(Debug)]
pub struct Journal {
    tx: Mutex<Option<SyncSender<Pending>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

/// Reads every intact record of the journal at `path` (none if it does not exist).
pub fn replay(path: &Path) -> io::Result<Vec<Record>> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes)?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    }
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: not a shardcache journal (bad magic)", path.display()),
        ));
    }
    let mut out = Vec::new();
    let mut at = MAGIC.len();
    while bytes.len() - at >= 12 {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
        let sum = u64::from_le_bytes(bytes[at + 4..at + 12].try_into().expect("8 bytes"));
        if len > MAX_RECORD || bytes.len() - at - 12 < len {
            break;
        }
        let payload = &bytes[at + 12..at + 12 + len];
        if xxh3_64(payload) != sum {
            break;
        }
        match Record::decode(payload) {
            Ok(r) => out.push(r),
            Err(_) => break,
        }
        at += 12 + len;
    }
    Ok(out)
}

fn frame(rec: &Record) -> Vec<u8> {
    let payload = rec.encode_to_vec();
    let mut f = Vec::with_capacity(12 + payload.len());
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(&xxh3_64(&payload).to_le_bytes());
    f.extend_from_slice(&payload);
    f
}

/// Makes a directory's entries durable (after a create, rename or unlink in it).
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Journal {
    /// Writes `records` as a new journal at `path` (atomically: temp file, fsync,
    /// rename, fsync of the directory) and opens it for appends.
    pub fn create(path: &Path, records: impl IntoIterator<Item = Record>) -> io::Result<Self> {
        let tmp: PathBuf = path.with_extension("tmp");
        {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)?;
            let mut buf = Vec::with_capacity(1 << 20);
            buf.extend_from_slice(MAGIC);
            for r in records {
                buf.extend_from_slice(&frame(&r));
                if buf.len() >= 1 << 20 {
                    f.write_all(&buf)?;
                    buf.clear();
                }
            }
            f.write_all(&buf)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        if let Some(parent) = path.parent() {
            sync_dir(parent)?;
        }
        let file = OpenOptions::new().append(true).open(path)?;
        let (tx, rx) = sync_channel(4096);
        let writer = std::thread::Builder::new()
            .name("sc-journal".into())
            .spawn(move || writer_loop(file, rx))?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
        })
    }

    /// Appends `rec` and returns once it is durable. Fails if the journal is closed or a
    /// previous write failed (the journal then refuses everything: nothing new becomes
    /// visible, which is safe).
    pub fn append(&self, rec: &Record) -> io::Result<()> {
        let (done_tx, done_rx) = sync_channel(1);
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(tx) = tx else {
            return Err(io::Error::other("journal closed"));
        };
        tx.send((frame(rec), done_tx))
            .map_err(|_| io::Error::other("journal writer stopped"))?;
        match done_rx.recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(io::Error::new(e.kind(), e.to_string())),
            Err(_) => Err(io::Error::other("journal writer stopped")),
        }
    }

    /// Stops accepting appends and waits for the writer to finish what was queued.
    pub fn close(&self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        self.close();
    }
}

fn writer_loop(mut file: File, rx: Receiver<Pending>) {
    let mut failed: Option<Arc<io::Error>> = None;
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(p) => batch.push(p),
                Err(_) => break,
            }
        }
        let result = match &failed {
            Some(e) => Err(e.clone()),
            None => {
                let mut buf = Vec::with_capacity(batch.iter().map(|(f, _)| f.len()).sum());
                for (f, _) in &batch {
                    buf.extend_from_slice(f);
                }
                match file.write_all(&buf).and_then(|()| file.sync_data()) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        tracing::error!(error = %e, "journal write failed; the cache stops admitting data");
                        let e = Arc::new(e);
                        failed = Some(e.clone());
                        Err(e)
                    }
                }
            }
        };
        for (_, done) in batch {
            let _ = done.send(result.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardcache_proto::store::v1::{BlockAdded, record::Kind};

    fn block(i: u64) -> Record {
        Record {
            kind: Some(Kind::BlockAdded(BlockAdded {
                key: vec![1; 16],
                index: i,
                len: 10,
                xxh3: i,
                generation: 1,
            })),
        }
    }

    #[test]
    fn appends_survive_reopen_and_a_torn_tail_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("journal");
        let j = Journal::create(&p, vec![block(0)]).unwrap();
        for i in 1..50 {
            j.append(&block(i)).unwrap();
        }
        j.close();
        assert_eq!(replay(&p).unwrap().len(), 50);
        // A crash mid-append leaves a partial frame: replay keeps everything before it.
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        let torn = frame(&block(99));
        f.write_all(&torn[..torn.len() - 3]).unwrap();
        assert_eq!(replay(&p).unwrap().len(), 50);
        // A corrupted byte in the middle stops replay there.
        let mut bytes = std::fs::read(&p).unwrap();
        let mid = MAGIC.len() + 10 * torn.len() + 14;
        bytes[mid] ^= 0xff;
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(replay(&p).unwrap().len(), 10);
    }

    #[test]
    fn concurrent_appends_are_all_durable() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("journal");
        let j = Arc::new(Journal::create(&p, Vec::new()).unwrap());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let j = j.clone();
                std::thread::spawn(move || {
                    for i in 0..100 {
                        j.append(&block(t * 1000 + i)).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        j.close();
        assert_eq!(replay(&p).unwrap().len(), 800);
        assert!(
            j.append(&block(1)).is_err(),
            "closed journal refuses appends"
        );
    }
}

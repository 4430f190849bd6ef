//! One conformance suite per seam, as plain functions over the trait, run against every
//! implementation (real, in-memory, wrapped), so that a twin cannot drift from the real
//! one: [`sources`] for [`BlockSource`]s, [`providers`] for [`BlockProvider`]s.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{BlockProvider, BlockRequest, BlockSource, Fetched, Target};
use crate::backing::{Stat, Version};
use crate::checksum::block_xxh3;
use crate::store::Key;

/// The block size the suites use.
pub const BS: usize = 4096;

/// What the source suite needs to set up a source's contents.
pub trait SourceFixture {
    fn source(&self) -> &dyn BlockSource;
    /// The name of the root the fixture's targets are under.
    fn root(&self) -> &str;
    /// Makes `data` the content of `path`: a new version, replacing any earlier one.
    fn put(&self, path: &str, data: &[u8]) -> Arc<Target>;
}

/// What the provider suite needs to set up a node's backing store.
pub trait ProviderFixture {
    fn provider(&self) -> &dyn BlockProvider;
    /// Makes `data` the content of `path` on the backing store: a new version, replacing
    /// any earlier one (nothing of it cached).
    fn put(&self, path: &str, data: &[u8]) -> Arc<Target>;
}

/// A version (inode `ino`) of `path` under root `/r`, `len` bytes long, to be filled.
pub fn target(path: &str, len: usize, ino: u64) -> Arc<Target> {
    let version = Version {
        size: len as u64,
        ino,
        ..Version::default()
    };
    Arc::new(Target {
        root: 0,
        rel: path.to_owned(),
        key: Key::of("/r", path, &version),
        stat: Arc::new(Stat {
            path: path.to_owned(),
            dirs: Vec::new(),
            owner: Default::default(),
            version,
        }),
        peer_ok: true,
    })
}

/// The request for block `index` of `t` under `root`, blocks of `bs` bytes.
pub fn request<'a>(t: &'a Target, root: &'a str, index: usize, bs: usize) -> BlockRequest<'a> {
    let offset = (index * bs) as u64;
    BlockRequest {
        target: t,
        root,
        index,
        offset,
        len: (t.stat.version.size.saturating_sub(offset) as usize).min(bs),
        prefetch: false,
    }
}

fn content(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ seed.wrapping_mul(31))
        .collect()
}

/// Runs every source check, each on a fresh fixture.
pub fn sources<F: SourceFixture>(new: &dyn Fn() -> F) {
    every_block_comes_back_exactly(&new());
    a_replaced_version_is_never_got(&new());
    an_unknown_file_is_never_got(&new());
}

fn every_block_comes_back_exactly(fx: &dyn SourceFixture) {
    let data = content(2 * BS + BS / 2, 1);
    let t = fx.put("d/f", &data);
    for i in 0..3 {
        // A buffer kept from an earlier, longer block, full of other bytes.
        let mut buf = vec![0xA5; 3 * BS];
        let req = request(&t, fx.root(), i, BS);
        let got = fx.source().fetch(&req, &mut buf).unwrap();
        let Fetched::Got { xxh3 } = got else {
            panic!("{}: block {i}: {got:?}", fx.source().name())
        };
        let want = &data[i * BS..((i + 1) * BS).min(data.len())];
        assert_eq!(buf.len(), want.len(), "block {i}: its length exactly");
        assert!(buf == want, "block {i}: its bytes exactly");
        if let Some(sum) = xxh3 {
            assert_eq!(
                sum,
                block_xxh3(want),
                "block {i}: the checksum of its bytes"
            );
        }
    }
}

fn a_replaced_version_is_never_got(fx: &dyn SourceFixture) {
    let old = fx.put("f", &content(BS, 2));
    let _new = fx.put("f", &content(BS, 3));
    let mut buf = Vec::new();
    let got = fx
        .source()
        .fetch(&request(&old, fx.root(), 0, BS), &mut buf);
    assert!(
        !matches!(got, Ok(Fetched::Got { .. })),
        "{}: a block of a version that is gone: {got:?}",
        fx.source().name()
    );
}

fn an_unknown_file_is_never_got(fx: &dyn SourceFixture) {
    let t = target("never-put", BS, 1 << 40);
    let mut buf = Vec::new();
    let got = fx.source().fetch(&request(&t, fx.root(), 0, BS), &mut buf);
    assert!(
        !matches!(got, Ok(Fetched::Got { .. })),
        "{}: a file never put: {got:?}",
        fx.source().name()
    );
}

/// Runs every provider check, each on a fresh fixture.
pub fn providers<F: ProviderFixture>(new: &dyn Fn() -> F) {
    an_uncached_block_is_not_read(&new());
    a_fill_lands_every_block_with_its_checksum(&new());
    a_replaced_version_is_not_filled(&new());
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

fn an_uncached_block_is_not_read(fx: &dyn ProviderFixture) {
    let t = fx.put("f", &content(BS, 4));
    let mut buf = Vec::new();
    assert_eq!(fx.provider().read(&t.key, 0, &mut buf), None);
}

fn a_fill_lands_every_block_with_its_checksum(fx: &dyn ProviderFixture) {
    assert_eq!(fx.provider().block_size() as usize, BS);
    let data = content(BS + BS / 3, 5);
    let t = fx.put("d/f", &data);
    for i in 0..2 {
        assert!(fx.provider().fill(&t, i, deadline()), "block {i} filled");
        assert!(
            fx.provider().fill(&t, i, deadline()),
            "block {i}: present already"
        );
        let mut buf = vec![0x5A; 2 * BS];
        let sum = fx.provider().read(&t.key, i, &mut buf);
        let want = &data[i * BS..((i + 1) * BS).min(data.len())];
        assert!(buf == want, "block {i}: its bytes exactly");
        assert_eq!(sum, Some(block_xxh3(want)), "block {i}: its checksum");
    }
}

fn a_replaced_version_is_not_filled(fx: &dyn ProviderFixture) {
    let old = fx.put("f", &content(BS, 6));
    let _new = fx.put("f", &content(BS, 7));
    assert!(!fx.provider().fill(&old, 0, deadline()));
    assert_eq!(fx.provider().read(&old.key, 0, &mut Vec::new()), None);
}

//! Prefetch manifests: what a job will read, and in which order (docs/MANIFEST.md).
//!
//! [`Manifest::from_json`] parses and validates in one step. Every error names the
//! field it is about (`plan.ranks[2]: …`), and a manifest that fails validation is never
//! half-applied: callers only ever see a fully valid [`Manifest`].

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::shuffle;

/// Largest manifest accepted, in bytes of JSON.
pub const MAX_BYTES: usize = 64 << 20;
/// Most files one manifest may list.
pub const MAX_FILES: usize = 10_000_000;
/// Most items over all epochs of a `sequence` plan.
pub const MAX_SEQUENCE_ITEMS: usize = 50_000_000;
/// Most epochs of a `shuffle` plan.
pub const MAX_EPOCHS: u64 = 100_000;
/// Largest world size.
pub const MAX_WORLD: u64 = 1 << 20;
/// Longest path, in bytes.
pub const MAX_PATH: usize = 4096;
/// Longest job id, in bytes.
pub const MAX_JOB_ID: usize = 128;

/// A validated prefetch manifest. Only [`Manifest::from_json`] makes one from text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Manifest {
    /// Format version; only `1` exists.
    pub version: u32,
    /// Job id: 1–128 characters of `[A-Za-z0-9._:-]`.
    pub job: String,
    /// Absolute path of the dataset root on the shared file system.
    pub root: String,
    /// The dataset's files, relative to `root`.
    pub files: Files,
    /// The files never change while the job runs: stat each once, never again.
    pub immutable: bool,
    /// The access plan.
    pub plan: Plan,
}

/// The dataset's files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Files {
    /// An explicit list; a file's index in it is its number in the plan.
    List(Vec<FileSpec>),
    /// Every regular file under `root` matching a glob (`*`, `?`, `**`), in path order.
    Glob {
        /// The pattern, relative to `root`.
        glob: String,
    },
}

/// One listed file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FileSpec {
    /// Just the path.
    Path(String),
    /// The path and, optionally, its size (saves a stat when `immutable`).
    Sized {
        /// Relative path.
        path: String,
        /// Size in bytes.
        #[serde(default)]
        size: Option<u64>,
    },
}

impl FileSpec {
    /// The relative path.
    pub fn path(&self) -> &str {
        match self {
            FileSpec::Path(p) | FileSpec::Sized { path: p, .. } => p,
        }
    }

    /// The declared size, if any.
    pub fn size(&self) -> Option<u64> {
        match self {
            FileSpec::Path(_) => None,
            FileSpec::Sized { size, .. } => *size,
        }
    }
}

/// The order of reads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Plan {
    /// An explicit order per epoch (for any sampler).
    Sequence {
        /// `epochs[e]` is the order of epoch `first_epoch + e`.
        epochs: Vec<Vec<Item>>,
        /// The epoch number of `epochs[0]`.
        first_epoch: u64,
    },
    /// Orders computed from a seed by a named shuffle algorithm, sliced per rank like
    /// PyTorch's `DistributedSampler`.
    Shuffle {
        /// A name from [`shuffle::ALGORITHMS`].
        algorithm: String,
        /// The sampler's seed.
        seed: u64,
        /// Number of epochs, starting at `first_epoch`.
        epochs: u64,
        /// Ranks in the job.
        world_size: u64,
        /// The ranks running on this node.
        ranks: Vec<u64>,
        /// Drop the tail instead of padding (as `DistributedSampler(drop_last=...)`).
        drop_last: bool,
        /// The first epoch number.
        first_epoch: u64,
    },
}

/// The JSON shape of a manifest, before the plan is read by its kind. (An internally
/// tagged enum would hide the plan's field paths from error messages.)
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    version: u32,
    job: String,
    root: String,
    files: Files,
    #[serde(default)]
    immutable: bool,
    plan: serde_json::Value,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSequence {
    #[serde(rename = "kind")]
    _kind: String,
    epochs: Vec<Vec<Item>>,
    #[serde(default)]
    first_epoch: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawShuffle {
    #[serde(rename = "kind")]
    _kind: String,
    algorithm: String,
    seed: u64,
    epochs: u64,
    world_size: u64,
    ranks: Vec<u64>,
    #[serde(default)]
    drop_last: bool,
    #[serde(default)]
    first_epoch: u64,
}

/// Deserializes `T` from JSON, naming the failing field under `prefix`.
fn parse_at<'de, T: Deserialize<'de>>(
    prefix: &str,
    de: impl serde::Deserializer<'de, Error = serde_json::Error>,
) -> Result<T, ManifestError> {
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let field = match (prefix, path.as_str()) {
            ("", ".") | ("", "?") => "manifest".to_owned(),
            (p, ".") => p.to_owned(),
            ("", sub) => sub.to_owned(),
            (p, sub) => format!("{p}.{sub}"),
        };
        err(field, e.into_inner().to_string())
    })
}

/// One read of a `sequence` plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Item {
    /// A whole file, by its index in `files`.
    Index(u64),
    /// A whole file, by path.
    Path(String),
    /// A byte range of a file.
    Range {
        /// The file, by index or path.
        file: FileRef,
        /// First byte.
        offset: u64,
        /// Number of bytes.
        length: u64,
    },
}

/// A reference to a listed file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FileRef {
    /// By index in `files`.
    Index(u64),
    /// By path.
    Path(String),
}

/// A manifest that cannot be accepted. `field` is where the problem is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ManifestError {
    /// Dotted path of the offending field (`plan.ranks[1]`), or `manifest`.
    pub field: String,
    /// What is wrong and what is expected.
    pub message: String,
}

fn err(field: impl Into<String>, message: impl Into<String>) -> ManifestError {
    ManifestError {
        field: field.into(),
        message: message.into(),
    }
}

/// Checks a relative dataset path: not empty, no leading `/`, no `.`/`..`/empty
/// components, no NUL, at most [`MAX_PATH`] bytes.
pub fn check_relative(field: &str, p: &str) -> Result<(), ManifestError> {
    if p.is_empty() {
        return Err(err(field, "empty path"));
    }
    if p.len() > MAX_PATH {
        return Err(err(field, format!("path longer than {MAX_PATH} bytes")));
    }
    if p.starts_with('/') {
        return Err(err(field, "must be relative to `root`"));
    }
    if p.contains('\0') {
        return Err(err(field, "contains a NUL byte"));
    }
    if p.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return Err(err(field, "must not contain empty, `.` or `..` components"));
    }
    Ok(())
}

impl Manifest {
    /// Parses and validates a JSON manifest.
    pub fn from_json(text: &str) -> Result<Self, ManifestError> {
        if text.len() > MAX_BYTES {
            return Err(err("manifest", format!("larger than {MAX_BYTES} bytes")));
        }
        let raw: RawManifest = parse_at("", &mut serde_json::Deserializer::from_str(text))?;
        let plan = match raw.plan.get("kind").and_then(serde_json::Value::as_str) {
            Some("sequence") => {
                let s: RawSequence = parse_at("plan", raw.plan)?;
                Plan::Sequence {
                    epochs: s.epochs,
                    first_epoch: s.first_epoch,
                }
            }
            Some("shuffle") => {
                let s: RawShuffle = parse_at("plan", raw.plan)?;
                Plan::Shuffle {
                    algorithm: s.algorithm,
                    seed: s.seed,
                    epochs: s.epochs,
                    world_size: s.world_size,
                    ranks: s.ranks,
                    drop_last: s.drop_last,
                    first_epoch: s.first_epoch,
                }
            }
            _ => return Err(err("plan.kind", "must be \"sequence\" or \"shuffle\"")),
        };
        let m = Manifest {
            version: raw.version,
            job: raw.job,
            root: raw.root,
            files: raw.files,
            immutable: raw.immutable,
            plan,
        };
        m.validate()?;
        Ok(m)
    }

    /// Checks every rule that the JSON shape alone does not.
    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.version != 1 {
            return Err(err(
                "version",
                format!("unsupported version {} (this build reads 1)", self.version),
            ));
        }
        if self.job.is_empty()
            || self.job.len() > MAX_JOB_ID
            || !self
                .job
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
        {
            return Err(err(
                "job",
                format!("1–{MAX_JOB_ID} characters of A–Z a–z 0–9 . _ : -"),
            ));
        }
        if !self.root.starts_with('/') || self.root.contains('\0') || self.root.len() > MAX_PATH {
            return Err(err("root", "must be an absolute path"));
        }
        let names: Option<Vec<&str>> = match &self.files {
            Files::List(list) => {
                if list.is_empty() {
                    return Err(err("files", "lists no file"));
                }
                if list.len() > MAX_FILES {
                    return Err(err("files", format!("more than {MAX_FILES} files")));
                }
                let mut seen = HashSet::with_capacity(list.len());
                for (i, f) in list.iter().enumerate() {
                    let field = format!("files[{i}]");
                    check_relative(&field, f.path())?;
                    if !seen.insert(f.path()) {
                        return Err(err(field, format!("`{}` is listed twice", f.path())));
                    }
                }
                Some(list.iter().map(FileSpec::path).collect())
            }
            Files::Glob { glob } => {
                check_relative("files.glob", glob)?;
                None
            }
        };
        match &self.plan {
            Plan::Sequence { epochs, .. } => {
                if epochs.is_empty() {
                    return Err(err("plan.epochs", "no epoch"));
                }
                let total: usize = epochs.iter().map(Vec::len).sum();
                if total > MAX_SEQUENCE_ITEMS {
                    return Err(err(
                        "plan.epochs",
                        format!("more than {MAX_SEQUENCE_ITEMS} items"),
                    ));
                }
                let index: Option<std::collections::HashMap<&str, usize>> = names
                    .as_ref()
                    .map(|n| n.iter().enumerate().map(|(i, p)| (*p, i)).collect());
                for (e, items) in epochs.iter().enumerate() {
                    for (k, item) in items.iter().enumerate() {
                        let field = format!("plan.epochs[{e}][{k}]");
                        let (r, len) = match item {
                            Item::Index(i) => (FileRef::Index(*i), None),
                            Item::Path(p) => (FileRef::Path(p.clone()), None),
                            Item::Range {
                                file,
                                length,
                                offset,
                            } => {
                                if *length == 0 {
                                    return Err(err(
                                        format!("{field}.length"),
                                        "must be at least 1",
                                    ));
                                }
                                if offset.checked_add(*length).is_none() {
                                    return Err(err(
                                        format!("{field}.offset"),
                                        "offset + length overflows",
                                    ));
                                }
                                (file.clone(), Some((*offset, *length)))
                            }
                        };
                        let resolved = match (&r, &names, &index) {
                            (FileRef::Index(i), Some(n), _) => {
                                if *i as usize >= n.len() {
                                    return Err(err(
                                        field,
                                        format!("file index {i} is not listed ({} files)", n.len()),
                                    ));
                                }
                                Some(*i as usize)
                            }
                            (FileRef::Index(_), None, _) => {
                                return Err(err(
                                    field,
                                    "a file index needs an explicit `files` list",
                                ));
                            }
                            (FileRef::Path(p), _, Some(ix)) => match ix.get(p.as_str()) {
                                Some(i) => Some(*i),
                                None => return Err(err(field, format!("`{p}` is not in `files`"))),
                            },
                            (FileRef::Path(p), _, None) => {
                                check_relative(&field, p)?;
                                None
                            }
                        };
                        if let (Some(i), Some((off, l)), Files::List(list)) =
                            (resolved, len, &self.files)
                            && let Some(size) = list[i].size()
                            && off + l > size
                        {
                            return Err(err(
                                field,
                                format!("range {off}+{l} is past the end of a {size}-byte file"),
                            ));
                        }
                    }
                }
            }
            Plan::Shuffle {
                algorithm,
                epochs,
                world_size,
                ranks,
                ..
            } => {
                if !shuffle::ALGORITHMS.contains(&algorithm.as_str()) {
                    return Err(err(
                        "plan.algorithm",
                        format!(
                            "unknown algorithm `{algorithm}` (this build knows: {})",
                            shuffle::ALGORITHMS.join(", ")
                        ),
                    ));
                }
                if *epochs == 0 || *epochs > MAX_EPOCHS {
                    return Err(err(
                        "plan.epochs",
                        format!("must be between 1 and {MAX_EPOCHS}"),
                    ));
                }
                if *world_size == 0 || *world_size > MAX_WORLD {
                    return Err(err(
                        "plan.world_size",
                        format!("must be between 1 and {MAX_WORLD}"),
                    ));
                }
                if ranks.is_empty() {
                    return Err(err("plan.ranks", "names no rank on this node"));
                }
                let mut seen = HashSet::new();
                for (i, r) in ranks.iter().enumerate() {
                    if r >= world_size {
                        return Err(err(
                            format!("plan.ranks[{i}]"),
                            format!("rank {r} is outside a world of {world_size}"),
                        ));
                    }
                    if !seen.insert(r) {
                        return Err(err(
                            format!("plan.ranks[{i}]"),
                            format!("rank {r} is named twice"),
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHUFFLE: &str = r#"{
        "version": 1, "job": "resnet50.run-7", "root": "/lustre/imagenet",
        "files": ["train/0.tar", {"path": "train/1.tar", "size": 1048576}, "train/2.tar"],
        "immutable": true,
        "plan": {"kind": "shuffle", "algorithm": "pcg64-fisher-yates/v1", "seed": 42,
                 "epochs": 4, "world_size": 8, "ranks": [0, 1]}
    }"#;

    fn with(patch: impl Fn(&mut serde_json::Value)) -> String {
        let mut v: serde_json::Value = serde_json::from_str(SHUFFLE).unwrap();
        patch(&mut v);
        v.to_string()
    }

    fn field_of(text: &str) -> String {
        Manifest::from_json(text).unwrap_err().field
    }

    #[test]
    fn a_valid_shuffle_manifest_parses() {
        let m = Manifest::from_json(SHUFFLE).unwrap();
        assert!(m.immutable);
        let Files::List(files) = &m.files else {
            panic!()
        };
        assert_eq!(files[1].size(), Some(1048576));
        assert!(matches!(
            m.plan,
            Plan::Shuffle {
                drop_last: false,
                first_epoch: 0,
                ..
            }
        ));
    }

    #[test]
    fn a_valid_sequence_manifest_parses() {
        let m = Manifest::from_json(
            r#"{"version": 1, "job": "j", "root": "/d", "files": ["a", {"path": "b", "size": 100}],
                "plan": {"kind": "sequence", "epochs": [[1, "a", {"file": 1, "offset": 10, "length": 90}]]}}"#,
        )
        .unwrap();
        assert!(matches!(&m.plan, Plan::Sequence { epochs, .. } if epochs[0].len() == 3));
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(field_of(&with(|v| v["version"] = 2.into())), "version");
        assert_eq!(field_of(&with(|v| v["job"] = "has space".into())), "job");
        assert_eq!(field_of(&with(|v| v["root"] = "relative".into())), "root");
        assert_eq!(
            field_of(&with(|v| v["files"][2] = "../etc/passwd".into())),
            "files[2]"
        );
        assert_eq!(
            field_of(&with(|v| v["files"][2] = "train/0.tar".into())),
            "files[2]"
        );
        assert_eq!(
            field_of(&with(|v| v["files"] = serde_json::json!([]))),
            "files"
        );
        assert_eq!(
            field_of(&with(|v| v["plan"]["algorithm"] = "mt19937".into())),
            "plan.algorithm"
        );
        assert_eq!(
            field_of(&with(|v| v["plan"]["ranks"] = serde_json::json!([0, 8]))),
            "plan.ranks[1]"
        );
        assert_eq!(
            field_of(&with(|v| v["plan"]["ranks"] = serde_json::json!([1, 1]))),
            "plan.ranks[1]"
        );
        assert_eq!(
            field_of(&with(|v| v["plan"]["epochs"] = 0.into())),
            "plan.epochs"
        );
        assert_eq!(
            field_of(&with(|v| v["plan"]["world_size"] = 0.into())),
            "plan.world_size"
        );
        assert_eq!(
            field_of(&with(|v| v["plan"]["seed"] = "x".into())),
            "plan.seed"
        );
        assert_eq!(
            field_of(&with(|v| v["plan"]["extra"] = 1.into())),
            "plan.extra"
        );
        assert_eq!(
            field_of(&with(|v| v["plan"]["kind"] = "random".into())),
            "plan.kind"
        );
        assert_eq!(field_of(&with(|v| v["colour"] = 1.into())), "colour");
        assert_eq!(field_of("{not json"), "manifest");
    }

    #[test]
    fn sequence_items_must_refer_to_listed_files_and_ranges_fit() {
        let seq = |items: serde_json::Value| {
            serde_json::json!({"version": 1, "job": "j", "root": "/d",
                "files": ["a", {"path": "b", "size": 100}],
                "plan": {"kind": "sequence", "epochs": [["a", items]]}})
            .to_string()
        };
        assert_eq!(field_of(&seq(serde_json::json!(2))), "plan.epochs[0][1]");
        assert_eq!(field_of(&seq(serde_json::json!("c"))), "plan.epochs[0][1]");
        assert_eq!(
            field_of(&seq(
                serde_json::json!({"file": "b", "offset": 50, "length": 51})
            )),
            "plan.epochs[0][1]"
        );
        assert_eq!(
            field_of(&seq(
                serde_json::json!({"file": "b", "offset": 5, "length": 0})
            )),
            "plan.epochs[0][1].length"
        );
        assert!(
            Manifest::from_json(&seq(
                serde_json::json!({"file": "b", "offset": 50, "length": 50})
            ))
            .is_ok()
        );
    }

    #[test]
    fn a_glob_is_checked_and_indexes_need_a_list() {
        let g = |glob: &str, item: serde_json::Value| {
            serde_json::json!({"version": 1, "job": "j", "root": "/d", "files": {"glob": glob},
                "plan": {"kind": "sequence", "epochs": [[item]]}})
            .to_string()
        };
        assert!(Manifest::from_json(&g("train/*.tar", serde_json::json!("train/0.tar"))).is_ok());
        assert_eq!(
            field_of(&g("/abs/*.tar", serde_json::json!("x"))),
            "files.glob"
        );
        assert_eq!(
            field_of(&g("*.tar", serde_json::json!(0))),
            "plan.epochs[0][0]"
        );
        assert_eq!(
            field_of(&g("*.tar", serde_json::json!("../x"))),
            "plan.epochs[0][0]"
        );
    }

    #[test]
    fn oversized_input_is_refused_before_parsing() {
        let big = " ".repeat(MAX_BYTES + 1);
        assert_eq!(field_of(&big), "manifest");
    }
}

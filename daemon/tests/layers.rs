//! The daemon's modules import only downward (docs/ARCHITECTURE.md, "Wiring"): each
//! module's code names only modules before it in [`ORDER`] (doc comments may point
//! anywhere). `daemon.rs` wires them all; `main.rs` and `lib.rs` are not layers.
#![allow(clippy::unwrap_used)] // a test that cannot unwrap has failed

use std::path::Path;

/// The module order, lowest first.
const ORDER: &[&str] = &[
    "units",
    "checksum",
    "status",
    "stats",
    "lifecycle",
    "clock",
    "ratelimit",
    "metrics",
    "backing",
    "config",
    "meta",
    "access",
    "glob",
    "planner",
    "store",
    "policy",
    "blocks",
    "fill",
    "peer",
    "jobs",
    "cache",
    "server",
    "daemon",
];

fn rank(module: &str) -> Option<usize> {
    ORDER.iter().position(|m| *m == module)
}

fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn modules_import_only_downward() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut wrong = Vec::new();
    for path in all {
        let rel = path.strip_prefix(&src).unwrap();
        let top = rel.iter().next().unwrap().to_str().unwrap();
        let module = top.trim_end_matches(".rs");
        if module == "main" || module == "lib" {
            continue;
        }
        let me = rank(module).unwrap_or_else(|| panic!("{module} is not in ORDER"));
        let text = std::fs::read_to_string(&path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            for (at, _) in code.match_indices("crate::") {
                let name: String = code[at + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                match rank(&name) {
                    Some(r) if r > me => {
                        wrong.push(format!("{}:{}: {module} uses {name}", rel.display(), n + 1))
                    }
                    Some(_) => {}
                    None => wrong.push(format!(
                        "{}:{}: {name} is not in ORDER",
                        rel.display(),
                        n + 1
                    )),
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the order:\n{}",
        wrong.join("\n")
    );
}

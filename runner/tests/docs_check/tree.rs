//! The repository's files and folders as a doc may name them: everything under the root but build outputs and git's
//! own folder, matched by whole path, by tail, or by file name, with placeholders (`*`, `TARGET`) matching any name.

use std::io;
use std::path::Path;

pub struct Tree {
    /// Relative, '/'-separated, sorted; a folder ends with '/'.
    entries: Vec<String>,
}

/// Folders that never hold what a doc names: build outputs (any `target`, fuzz/'s too) and git's store.
const SKIPPED: [&str; 2] = ["target", ".git"];

impl Tree {
    pub fn walk(root: &Path) -> io::Result<Tree> {
        let mut entries = Vec::new();
        let mut pending = vec![String::new()];
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(root.join(&dir))? {
                let entry = entry?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if entry.file_type()?.is_dir() {
                    if !SKIPPED.contains(&name.as_str()) {
                        let path = format!("{dir}{name}/");
                        entries.push(path.clone());
                        pending.push(path);
                    }
                } else {
                    entries.push(format!("{dir}{name}"));
                }
            }
        }
        entries.sort();
        Ok(Tree { entries })
    }

    /// Files whose path starts with `folder` (e.g. `runner/src/`) and ends with `.rs`.
    pub fn rust_files_under<'a>(&'a self, folder: &'a str) -> impl Iterator<Item = &'a str> {
        self.entries.iter().map(String::as_str).filter(move |e| e.starts_with(folder) && e.ends_with(".rs"))
    }

    /// Is there an entry whose whole path matches `pattern` (a trailing '/' asks for a folder)?
    pub fn has_path(&self, pattern: &str) -> bool {
        self.entries.iter().any(|e| path_matches(pattern, e, false))
    }

    /// Is there an entry whose last segments match `pattern` (`tests/bad_input.rs`, `scenarios/src/*.rs`)?
    pub fn has_tail(&self, pattern: &str) -> bool {
        self.entries.iter().any(|e| path_matches(pattern, e, true))
    }
}

fn path_matches(pattern: &str, entry: &str, tail: bool) -> bool {
    // A pattern with '/' at the end names a folder; one without it, a file or a folder.
    if pattern.ends_with('/') && !entry.ends_with('/') {
        return false;
    }
    let pat: Vec<&str> = pattern.trim_end_matches('/').split('/').collect();
    let ent: Vec<&str> = entry.trim_end_matches('/').split('/').collect();
    if pat.len() > ent.len() || (!tail && pat.len() != ent.len()) {
        return false;
    }
    let ent = &ent[ent.len() - pat.len()..];
    pat.iter().zip(ent).all(|(p, e)| segment_matches(p, e))
}

/// `TARGET`, `SHARD_DIR`: a name the reader fills in.
fn is_placeholder(segment: &str) -> bool {
    segment.len() >= 2
        && segment.chars().any(|c| c.is_ascii_uppercase())
        && segment.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

fn segment_matches(pattern: &str, name: &str) -> bool {
    if is_placeholder(pattern) {
        return true;
    }
    glob(pattern.as_bytes(), name.as_bytes())
}

/// `*` matches any run of characters; everything else itself.
fn glob(pattern: &[u8], name: &[u8]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some((b'*', rest)) => (0..=name.len()).any(|skip| glob(rest, &name[skip..])),
        Some((c, rest)) => name.first() == Some(c) && glob(rest, &name[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_folders_tails_and_placeholders() {
        let tree = Tree {
            entries: ["fuzz/", "fuzz/corpus/", "fuzz/corpus/hca/", "guest-driver/scenarios/src/smoke.rs"]
                .map(String::from)
                .to_vec(),
        };
        assert!(tree.has_path("fuzz/corpus/TARGET/"));
        assert!(tree.has_path("fuzz/corpus"));
        assert!(!tree.has_path("fuzz/corpus/hca/x"));
        assert!(tree.has_tail("scenarios/src/*.rs"));
        assert!(tree.has_tail("smoke.rs"));
        assert!(!tree.has_tail("channel/src/smoke.rs"));
        assert!(!tree.has_path("guest-driver/scenarios/src/smoke.rs/"));
    }
}

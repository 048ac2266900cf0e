//! Every repository path a doc names exists: a path under one of the top folders as written, a relative path
//! (`tests/bad_input.rs`) as the tail of some path, a bare source file name (`run.rs`) somewhere in the tree.

use super::markdown::Doc;
use super::tree::Tree;
use super::Problem;

/// The repository's top folders: a path that starts with one is a claim about the tree, whatever the doc's folder.
const ROOTS: [&str; 10] =
    ["proto/", "device/", "guest-driver/", "runner/", "images/", "ci/", "docs/", "fuzz/", ".github/", ".ci/"];

/// Relative paths and bare names are checked only for the repository's own kinds of file: `report.json`,
/// `vhca.sys` or `serial.log` are outputs a run writes, not files of the tree.
const SOURCE_EXTENSIONS: [&str; 5] = ["rs", "sh", "toml", "md", "yml"];

/// Names the docs use for the reader's own files: a suite file, the Windows suite docs/windows.md has them write.
const EXAMPLES: [&str; 2] = ["my.toml", "seed-windows.toml"];

/// What tools write into the tree and git ignores (fuzz/.gitignore): cargo-fuzz's crashes and coverage.
const OUTPUTS: [&str; 2] = ["fuzz/artifacts/", "fuzz/coverage/"];

pub fn check(doc: &Doc, tree: &Tree) -> Vec<Problem> {
    let mut out = Vec::new();
    for (i, line) in doc.lines.iter().enumerate() {
        for token in path_tokens(&without_urls(line)) {
            if let Some(why) = missing(&token, tree) {
                out.push(Problem { doc: doc.path.clone(), line: i + 1, claim: format!("`{token}`"), why });
            }
        }
    }
    out
}

/// Why `token` names nothing in the tree, or None if it does (or is not a repository path at all).
fn missing(token: &str, tree: &Tree) -> Option<String> {
    if token.starts_with('/') || OUTPUTS.iter().any(|o| token.starts_with(o)) {
        return None; // a guest's or the host's absolute path (/init, /dev/kvm)
    }
    if ROOTS.iter().any(|r| token.starts_with(r)) {
        return (!tree.has_path(token)).then(|| "no such file or folder in the repository".to_string());
    }
    let name = token.rsplit('/').next().unwrap_or(token);
    let source = name.rsplit_once('.').is_some_and(|(stem, ext)| {
        stem.chars().next().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') && SOURCE_EXTENSIONS.contains(&ext)
    });
    if !source || EXAMPLES.contains(&token) {
        return None;
    }
    if token.contains('/') {
        (!tree.has_tail(token)).then(|| "no path in the repository ends with this".to_string())
    } else {
        (!tree.has_tail(token)).then(|| "no file of this name in the repository".to_string())
    }
}

/// A URL's path is another site's, never this tree's.
fn without_urls(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(start) = ["https://", "http://"].iter().filter_map(|s| rest.find(s)).min() {
        out.push_str(&rest[..start]);
        let end = rest[start..]
            .find(|c: char| c.is_whitespace() || matches!(c, ')' | '>' | '`'))
            .map_or(rest.len(), |e| start + e);
        out.push(' ');
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '*' | '-')
}

/// Maximal runs of path characters that look like paths: with a '/' or a file extension; trailing dots (a
/// sentence's end, an ellipsis) dropped.
fn path_tokens(line: &str) -> Vec<String> {
    line.split(|c: char| !is_path_char(c))
        .map(|t| t.trim_end_matches('.'))
        .filter(|t| t.contains('/') || t.contains('.'))
        .filter(|t| t.chars().any(|c| c.is_ascii_alphabetic()))
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_skip_urls_and_keep_placeholders_apart() {
        let line = "see docs/suites.md, (https://example.com/docs/x.md) and `runner/tests/suites/<name>.toml`...";
        assert_eq!(path_tokens(&without_urls(line)), ["docs/suites.md", "runner/tests/suites/", ".toml"]);
    }
}

//! The docs checker: each claim of README.md and docs/*.md that the tree itself can tell (paths, command-line
//! flags, the crate map, counts, named threads), checked against one root and the binaries' own --help.

mod commands;
mod counts;
mod crate_map;
mod doc_index;
mod help;
mod markdown;
mod paths;
mod suite_errors;
mod tree;

use std::fmt;
use std::path::Path;

pub use help::{BinaryHelp, HelpSource};

/// A doc's claim the tree contradicts: the doc, the line, what it claims, and what the tree says instead.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    pub doc: String,
    pub line: usize,
    pub claim: String,
    pub why: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}: {}", self.doc, self.line, self.claim, self.why)
    }
}

pub struct Report {
    pub problems: Vec<Problem>,
    /// What could not be checked and why (a binary not built).
    pub unchecked: Vec<String>,
}

/// The dated record of every benchmark session: it names the files and flags of its day, which is its job.
const HISTORY: &str = "docs/bench-history.md";

/// Every docs/*.md, in name order.
fn pages(root: &Path) -> Result<Vec<String>, String> {
    let dir = std::fs::read_dir(root.join("docs")).map_err(|e| format!("docs/: {e}"))?;
    let mut pages: Vec<String> = dir
        .filter_map(|e| e.ok())
        .map(|e| format!("docs/{}", e.file_name().to_string_lossy()))
        .filter(|p| p.ends_with(".md"))
        .collect();
    pages.sort();
    Ok(pages)
}

/// Checks every doc under `root`; Err only when a fact the check needs cannot be read at all.
pub fn check(root: &Path, help: &dyn HelpSource) -> Result<Report, String> {
    let tree = tree::Tree::walk(root).map_err(|e| format!("{}: {e}", root.display()))?;
    let pages = pages(root)?;
    let docs: Vec<markdown::Doc> = std::iter::once("README.md".to_string())
        .chain(pages.iter().filter(|p| *p != HISTORY).cloned())
        .map(|p| markdown::Doc::load(root, &p).map_err(|e| format!("{p}: {e}")))
        .collect::<Result<_, _>>()?;
    let mut problems = Vec::new();
    let mut unchecked = Vec::new();
    for doc in &docs {
        problems.extend(paths::check(doc, &tree));
        problems.extend(commands::check(doc, help, &mut unchecked));
        problems.extend(suite_errors::check(doc));
    }
    problems.extend(doc_index::check(&docs[0], &pages));
    let crates = crate_map::workspace(root)?;
    match docs.iter().find(|d| d.path == counts::ARCHITECTURE) {
        Some(doc) => problems.extend(crate_map::check(doc, &crates)),
        None => return Err(format!("{} is missing", counts::ARCHITECTURE)),
    }
    let (facts, spawn_problems) = counts::Facts::read(root, &tree)?;
    problems.extend(spawn_problems);
    problems.extend(counts::check(&docs, &facts));
    problems.sort();
    problems.dedup();
    Ok(Report { problems, unchecked })
}

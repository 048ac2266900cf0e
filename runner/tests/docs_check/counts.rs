//! Counts the docs state that the code can tell: the seed suite's entries and concrete runs (from the suite file,
//! through vhca-suite's own parser), the VFIO ioctls the guest makes, and the named threads of the device and the
//! runner, each of which the thread diagram must show.

use super::markdown::{Doc, Paragraph};
use super::tree::Tree;
use super::Problem;
use std::path::Path;

pub const SEED_SUITE: &str = "runner/suite/suites/seed.toml";
pub const VFIO: &str = "guest-driver/guest/src/vfio.rs";
/// The processes whose threads the diagram draws.
const THREAD_SOURCES: [&str; 2] = ["device/src/", "runner/src/"];
pub const ARCHITECTURE: &str = "docs/architecture.md";
pub const THREAD_SECTION: &str = "Processes and threads of one run";
pub const SUITES: &str = "docs/suites.md";
pub const SEED_SECTION: &str = "The seed suite";

pub struct Facts {
    seed_entries: Vec<String>,
    seed_concrete_runs: usize,
    ioctls: usize,
    /// `WATCH_POLL`: how often the runner looks at a run's serial log, QMP and processes.
    watch_poll_ms: Option<usize>,
    threads: Vec<NamedThread>,
}

struct NamedThread {
    name: String,
    /// `file:line` of the spawn.
    at: String,
}

impl Facts {
    pub fn read(root: &Path, tree: &Tree) -> Result<(Facts, Vec<Problem>), String> {
        let read = |p: &str| std::fs::read_to_string(root.join(p)).map_err(|e| format!("{p}: {e}"));
        let seed =
            vhca_suite::Suite::parse(&read(SEED_SUITE)?, SEED_SUITE).map_err(|e| format!("{SEED_SUITE}: {e}"))?;
        let ioctls = code_part(&read(VFIO)?)
            .lines()
            .filter(|l| l.trim_start().starts_with("const VFIO_") && l.contains("= vfio_io("))
            .count();
        let (threads, problems) = named_threads(root, tree)?;
        let watch_poll_ms = tree
            .rust_files_under("runner/src/")
            .filter_map(|p| std::fs::read_to_string(root.join(p)).ok())
            .find_map(|text| {
                const DEFINITION: &str = "const WATCH_POLL: Duration = Duration::from_millis(";
                let rest = &text[text.find(DEFINITION)? + DEFINITION.len()..];
                rest[..rest.find(')')?].parse().ok()
            });
        let facts = Facts {
            seed_entries: seed.runs.iter().map(|r| r.name.clone()).collect(),
            seed_concrete_runs: seed.expand().len(),
            ioctls,
            watch_poll_ms,
            threads,
        };
        Ok((facts, problems))
    }
}

/// A file's text before its unit tests (`#[cfg(test)]` over a `mod`): a thread a test names is no thread of the
/// running program.
fn code_part(text: &str) -> &str {
    text.find("#[cfg(test)]\nmod ").map_or(text, |i| &text[..i])
}

/// Every `thread::Builder::new().name("…")` under the thread sources; a name passed in (`.name(thread_name)`) is
/// read from the callers of the enclosing function (`thread_sched::spawn("vhca-queues", …)`).
fn named_threads(root: &Path, tree: &Tree) -> Result<(Vec<NamedThread>, Vec<Problem>), String> {
    let mut files = Vec::new();
    for folder in THREAD_SOURCES {
        for path in tree.rust_files_under(folder) {
            let text = std::fs::read_to_string(root.join(path)).map_err(|e| format!("{path}: {e}"))?;
            files.push((path.to_string(), code_part(&text).to_string()));
        }
    }
    let mut threads = Vec::new();
    let mut problems = Vec::new();
    for (path, text) in &files {
        for (at, arg) in spawns(text) {
            let line = line_of(text, at);
            if let Some(name) = string_literal(arg) {
                threads.push(NamedThread { name, at: format!("{path}:{line}") });
                continue;
            }
            let function = text[..at].lines().rev().find_map(function_name);
            let stem = path.rsplit('/').next().unwrap_or(path).trim_end_matches(".rs");
            let callers: Vec<NamedThread> = match function {
                Some(f) => {
                    let call = format!("{stem}::{f}(");
                    files
                        .iter()
                        .flat_map(|(p, t)| t.match_indices(&call).map(move |(i, _)| (p, t, i)))
                        .filter_map(|(p, t, i)| {
                            let name = string_literal(&t[i + call.len()..])?;
                            Some(NamedThread { name, at: format!("{p}:{}", line_of(t, i)) })
                        })
                        .collect()
                }
                None => Vec::new(),
            };
            if callers.is_empty() {
                problems.push(Problem {
                    doc: path.clone(),
                    line,
                    claim: "a thread named by an expression".into(),
                    why: "neither a string literal nor a function whose callers pass one: the docs check cannot \
                          read its name for the thread diagram"
                        .into(),
                });
            }
            threads.extend(callers);
        }
    }
    Ok((threads, problems))
}

/// Each `thread::Builder::new().name(ARG` in `text`, however rustfmt broke it over lines: the offset of the match and
/// the text from ARG on.
fn spawns(text: &str) -> Vec<(usize, &str)> {
    text.match_indices("thread::Builder::new()")
        .filter_map(|(at, m)| {
            let rest = text[at + m.len()..].trim_start().strip_prefix(".name(")?;
            Some((at, rest))
        })
        .collect()
}

/// The 1-based line of byte `offset`.
fn line_of(text: &str, offset: usize) -> usize {
    1 + text[..offset].matches('\n').count()
}

/// `"name".into())` → `name`.
fn string_literal(text: &str) -> Option<String> {
    let rest = text.trim_start().strip_prefix('"')?;
    Some(rest[..rest.find('"')?].to_string())
}

/// `pub fn spawn<T: Send>(` → `spawn`.
fn function_name(line: &str) -> Option<&str> {
    let rest = &line[line.find("fn ")? + 3..];
    let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_'))?;
    (end > 0).then(|| &rest[..end])
}

pub fn check(docs: &[Doc], facts: &Facts) -> Vec<Problem> {
    let mut out = Vec::new();
    for doc in docs {
        for p in doc.paragraphs() {
            stated_counts(doc, &p, facts, &mut out);
        }
    }
    if let Some(doc) = docs.iter().find(|d| d.path == ARCHITECTURE) {
        threads_drawn(doc, facts, &mut out);
    }
    if let Some(doc) = docs.iter().find(|d| d.path == SUITES) {
        seed_entries_named(doc, facts, &mut out);
    }
    out
}

const NUMBERS: [&str; 21] = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
];

fn number(word: &str) -> Option<usize> {
    word.parse().ok().or_else(|| NUMBERS.iter().position(|n| n.eq_ignore_ascii_case(word)))
}

/// `N ioctls`; `N seed runs`; `every N ms the runner`; and where the paragraph is about the seed suite,
/// `N entries` and `N concrete runs`.
/// A sentence (or table row) with a date in it is a record of that day, not a claim about the tree now.
fn stated_counts(doc: &Doc, p: &Paragraph, facts: &Facts, out: &mut Vec<Problem>) {
    let text = &p.text;
    let lower = text.to_lowercase();
    let about_seed = lower.contains("seed suite") || lower.contains("seed.toml");
    let words = words(text);
    for (i, &(offset, word)) in words.iter().enumerate() {
        let Some(n) = number(word) else { continue };
        let next = |k: usize| words.get(i + k).map(|(_, w)| w.to_lowercase()).unwrap_or_default();
        let every = i > 0 && words[i - 1].1.eq_ignore_ascii_case("every");
        let (truth, what, fact_source) = match (next(1).as_str(), next(2).as_str()) {
            ("ioctls", _) => (facts.ioctls, "ioctls", VFIO),
            ("ms", "the") if every && next(3) == "runner" => match facts.watch_poll_ms {
                Some(ms) => (ms, "ms the runner", "runner/src's WATCH_POLL"),
                None => continue,
            },
            ("seed", "runs") => (facts.seed_concrete_runs, "seed runs", SEED_SUITE),
            ("concrete", "runs") if about_seed => (facts.seed_concrete_runs, "concrete runs", SEED_SUITE),
            ("entries", _) if about_seed => (facts.seed_entries.len(), "entries", SEED_SUITE),
            _ => continue,
        };
        if n == truth || has_date(context(text, offset, p.text.starts_with('|'))) {
            continue;
        }
        out.push(Problem {
            doc: doc.path.clone(),
            line: p.line_at(offset),
            claim: format!("\"{word} {what}\""),
            why: format!("{fact_source} has {truth}"),
        });
    }
}

/// The words of `text` (letters, digits, an apostrophe), each with its byte offset.
fn words(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in text.char_indices().chain([(text.len(), ' ')]) {
        if c.is_ascii_alphanumeric() || c == '\'' {
            start.get_or_insert(i);
        } else if let Some(s) = start.take() {
            out.push((s, &text[s..i]));
        }
    }
    out
}

/// The sentence around `offset` (the whole row in a table).
fn context(text: &str, offset: usize, row: bool) -> &str {
    if row {
        return text;
    }
    let ends = |i: usize| text.is_char_boundary(i) && (text[i..].starts_with(". ") || text[i..].starts_with(".\n"));
    let start = (0..offset).rev().find(|&i| ends(i)).map_or(0, |i| i + 2);
    let end = (offset..text.len()).find(|&i| ends(i)).unwrap_or(text.len());
    &text[start..end]
}

/// A `YYYY-MM-DD` date.
fn has_date(text: &str) -> bool {
    let b = text.as_bytes();
    let digits = |r: std::ops::Range<usize>| r.clone().all(|i| b[i].is_ascii_digit());
    (0..b.len().saturating_sub(9)).any(|i| {
        digits(i..i + 4) && b[i + 4] == b'-' && digits(i + 5..i + 7) && b[i + 7] == b'-' && digits(i + 8..i + 10)
    })
}

fn contains_word(text: &str, word: &str) -> bool {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    text.match_indices(word).any(|(i, _)| {
        !text[..i].chars().next_back().is_some_and(is_name)
            && !text[i + word.len()..].chars().next().is_some_and(is_name)
    })
}

fn section_text(doc: &Doc, title: &str) -> Option<(usize, String)> {
    let (start, end) = doc.section(title)?;
    Some((start, doc.lines[start - 1..end - 1].join("\n")))
}

fn threads_drawn(doc: &Doc, facts: &Facts, out: &mut Vec<Problem>) {
    let Some((line, text)) = section_text(doc, THREAD_SECTION) else {
        out.push(Problem {
            doc: doc.path.clone(),
            line: 1,
            claim: format!("section \"{THREAD_SECTION}\""),
            why: "missing".into(),
        });
        return;
    };
    for t in facts.threads.iter().filter(|t| !contains_word(&text, &t.name)) {
        out.push(Problem {
            doc: doc.path.clone(),
            line,
            claim: format!("thread \"{}\" ({})", t.name, t.at),
            why: "the source spawns it by this name; the thread diagram does not show it".into(),
        });
    }
}

fn seed_entries_named(doc: &Doc, facts: &Facts, out: &mut Vec<Problem>) {
    let Some((line, text)) = section_text(doc, SEED_SECTION) else {
        out.push(Problem {
            doc: doc.path.clone(),
            line: 1,
            claim: format!("section \"{SEED_SECTION}\""),
            why: "missing".into(),
        });
        return;
    };
    for name in facts.seed_entries.iter().filter(|n| !contains_word(&text, n)) {
        out.push(Problem {
            doc: doc.path.clone(),
            line,
            claim: format!("seed entry `{name}`"),
            why: format!("{SEED_SUITE} has it; the section does not name it"),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dated_sentence_is_a_record() {
        assert!(has_date(context("Today: 9 runs on 2026-11-30. Now 51 concrete runs.", 7, false)));
        assert!(!has_date(context("Today: 9 runs on 2026-11-30. Now 51 concrete runs.", 35, false)));
    }

    #[test]
    fn a_spawn_is_found_however_it_is_wrapped() {
        let text = "fn a() {\n    std::thread::Builder::new()\n        .name(\n            \"long-name\".into(),\n        )\n}\n";
        let found: Vec<(usize, Option<String>)> =
            spawns(text).into_iter().map(|(at, arg)| (line_of(text, at), string_literal(arg))).collect();
        assert_eq!(found, [(2, Some("long-name".to_string()))]);
    }

    #[test]
    fn words_match_whole() {
        assert!(contains_word("(\"event-log\", x)", "event-log"));
        assert!(!contains_word("\"event-log-signals\"", "event-log"));
    }
}

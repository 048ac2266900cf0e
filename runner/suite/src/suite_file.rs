//! Reads a suite file: serde + toml into raw, spanned structs (`raw`), then one validation pass (`checks`) that
//! collects every problem with the file, line and field it belongs to, so a bad file is fixed in one round instead
//! of one error at a time.

mod checks;
mod raw;

use std::fmt;

use crate::suite::Suite;
use crate::toml_location::{field_path_at, line_column};

/// The built-in seed suite (the seed threads' scenarios), compiled in.
pub const SEED_SUITE: &str = include_str!("../suites/seed.toml");
/// How messages name the built-in suite.
pub const SEED_SUITE_NAME: &str = "<built-in seed suite>";

/// One thing wrong with a suite file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based; 0 when the problem has no place in the text.
    pub line: usize,
    pub column: usize,
    /// Dotted path (`run[2].expect.on`), or `-` when the text did not parse far enough to name one.
    pub field: String,
    pub message: String,
}

/// Why a suite file was refused: every problem found, each with its place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct SuiteError {
    pub file: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for SuiteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}:{}:{}: {}: {}", self.file, p.line, p.column, p.field, p.message)?;
        }
        Ok(())
    }
}

impl Suite {
    /// Parses and validates a suite file's text. `file` is only used to name the file in messages.
    pub fn parse(text: &str, file: &str) -> Result<Suite, SuiteError> {
        let raw: raw::RawSuite = toml::from_str(text)
            .map_err(|e| SuiteError { file: file.to_string(), problems: vec![serde_problem(text, &e)] })?;
        checks::check(raw, text, file).map_err(|problems| SuiteError { file: file.to_string(), problems })
    }

    /// The built-in seed suite.
    pub fn seed() -> Result<Suite, SuiteError> {
        Suite::parse(SEED_SUITE, SEED_SUITE_NAME)
    }
}

fn serde_problem(text: &str, e: &toml::de::Error) -> Problem {
    let message = e.message().trim().to_string();
    let Some(span) = e.span() else {
        return Problem { line: 0, column: 0, field: "-".into(), message };
    };
    let (line, column) = line_column(text, span.start);
    let mut field = field_path_at(text, span.start).unwrap_or_else(|| "-".into());
    // A missing field's span is its table, and so is an unknown one's when a hand-written visitor refused it:
    // name the field itself.
    let named = ["missing field `", "unknown field `"]
        .iter()
        .find_map(|prefix| message.strip_prefix(prefix).and_then(|m| m.split('`').next()));
    if let Some(name) = named {
        if field == "-" {
            field = name.to_string();
        } else if !field.ends_with(&format!(".{name}")) && field != name {
            field = format!("{field}.{name}");
        }
    }
    Problem { line, column, field, message }
}

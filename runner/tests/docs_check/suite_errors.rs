//! A suite-file error a doc shows for an unknown key lists the keys the parser really takes there: the same key is
//! given to vhca-suite's parser in the smallest file that puts it at that place, and the two lists compared.

use super::markdown::Doc;
use super::Problem;

const UNKNOWN: &str = ": unknown field `";
const LIST: &str = "expected one of";

pub fn check(doc: &Doc) -> Vec<Problem> {
    let mut out = Vec::new();
    for (i, line) in doc.lines.iter().enumerate() {
        let Some(at) = line.find(UNKNOWN) else { continue };
        let Some(list_at) = line[at..].find(LIST).map(|o| at + o) else { continue };
        let field = line[..at].rsplit(": ").next().unwrap_or_default();
        let shown = backticked(&line[list_at..]);
        let problem =
            |why: String| Problem { doc: doc.path.clone(), line: i + 1, claim: format!("`{field}`: {LIST} …"), why };
        let Some(file) = smallest_file(field) else {
            out.push(problem("the check cannot build a suite file with a key at this place".into()));
            continue;
        };
        let message = match vhca_suite::Suite::parse(&file, "example.toml") {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        };
        let real = message.find(LIST).map(|l| backticked(&message[l..])).unwrap_or_default();
        if real != shown {
            out.push(problem(format!("the parser says: {}", message.trim())));
        }
    }
    out
}

/// The names in backticks, in order: "`name`, `modes`" → [name, modes].
fn backticked(text: &str) -> Vec<String> {
    text.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// A valid suite but for `field` (`run[2].expct`, `defaults.x`, `run[0].device.x`, `x`), set where its path says.
fn smallest_file(field: &str) -> Option<String> {
    let parts: Vec<&str> = field.split('.').collect();
    let (key, parents) = parts.split_last()?;
    let run = "[[run]]\nname = \"a\"\nexpect = \"pass\"\n";
    let place = match parents {
        [] => String::new(),
        ["defaults"] => "[defaults]\n".to_string(),
        [r] if r.starts_with("run[") => run.to_string(),
        [r, table @ ("device" | "guest")] if r.starts_with("run[") => format!("{run}[run.{table}]\n"),
        _ => return None,
    };
    Some(format!("name = \"example\"\n{place}{key} = 1\n"))
}

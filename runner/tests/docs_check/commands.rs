//! Every flag a doc shows for vhca-run, vhca-device or vhca-load (in code blocks and inline code) is one its command
//! accepts: the words after the program name are walked down its subcommands (`vhca-run report merge`), each flag
//! checked against that command's own `--help`.

use super::help::HelpSource;
use super::markdown::Doc;
use super::Problem;

/// One command line a doc shows: the program and the words after it, each with the line it is on (a usage block
/// continues one command over several lines).
struct Invocation {
    program: String,
    words: Vec<(usize, String)>,
}

pub fn check(doc: &Doc, help: &dyn HelpSource, unchecked: &mut Vec<String>) -> Vec<Problem> {
    let mut out = Vec::new();
    for inv in invocations(doc, &help.programs()) {
        walk(doc, &inv, help, unchecked, &mut out);
    }
    out
}

fn invocations(doc: &Doc, programs: &[String]) -> Vec<Invocation> {
    let mut out: Vec<Invocation> = Vec::new();
    // In a code block a line that is indented, or starts with a label (`RUN:`, `global:`), goes on with the
    // command above it, as a usage synopsis is laid out.
    let mut open: Option<Invocation> = None;
    let mut last_line = 0;
    for code in doc.code_lines() {
        if code.info == "toml" || code.info == "json" || code.info == "jsonl" {
            continue;
        }
        let in_same_block = code.line == last_line + 1;
        last_line = code.line;
        if is_picture(code.text) {
            out.extend(open.take());
            continue;
        }
        let alternation = code.info == "text";
        let words = words(strip_comment(code.text), alternation);
        if let Some(inv) = start(&words, programs, code.line) {
            out.extend(open.replace(inv));
            continue;
        }
        let continues = code.text.starts_with([' ', '\t']) || words.first().is_some_and(|w| w.ends_with(':'));
        match &mut open {
            Some(inv) if in_same_block && continues => inv.words.extend(words.into_iter().map(|w| (code.line, w))),
            _ => out.extend(open.take()),
        }
    }
    out.extend(open);
    for (line, span) in doc.code_spans() {
        out.extend(start(&words(&span, true), programs, line));
    }
    out
}

/// The command that starts in `words`, if one does: a program name (or a path ending in one) in command position,
/// not the value of an option (`-p vhca-run`, `--device-bin …/vhca-device`) nor part of an assignment.
fn start(words: &[String], programs: &[String], line: usize) -> Option<Invocation> {
    let at = words.iter().enumerate().position(|(i, w)| {
        let w = w.trim_start_matches(['(', '[']);
        let named = programs.iter().any(|p| w == p || w.ends_with(&format!("/{p}")));
        let value_of_option = i > 0 && words[i - 1].starts_with('-') && words[i - 1] != "--";
        named && !w.contains('=') && !value_of_option
    })?;
    let program = words[at].trim_start_matches(['(', '[']).rsplit('/').next()?.to_string();
    Some(Invocation { program, words: words[at + 1..].iter().map(|w| (line, w.clone())).collect() })
}

/// A line of a diagram (box drawing, arrows) names programs as boxes, never as command lines.
fn is_picture(line: &str) -> bool {
    line.chars().any(|c| matches!(c, '\u{2190}'..='\u{21FF}' | '\u{2500}'..='\u{25FF}'))
}

/// A shell comment (` # …`) says what a line does; it shows no flag.
fn strip_comment(line: &str) -> &str {
    if line.trim_start().starts_with('#') {
        return "";
    }
    line.find(" #").map_or(line, |i| &line[..i])
}

/// Shell-like words: quotes group (only where a word starts, so `run's` stays one word); in a shell line `|`, `;`,
/// `&&` and `||` end the command, in a usage synopsis (`alternation`) `|` only separates alternatives.
fn words(line: &str, alternation: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = line.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let mut word = String::new();
        if c == '\'' || c == '"' {
            chars.next();
            for d in chars.by_ref() {
                if d == c {
                    break;
                }
                word.push(d);
            }
            out.push(format!("'{word}'"));
            continue;
        }
        while let Some(&d) = chars.peek() {
            if d.is_whitespace() {
                break;
            }
            word.push(d);
            chars.next();
        }
        if !alternation && matches!(word.as_str(), "|" | ";" | "&&" | "||") {
            break;
        }
        out.push(word);
    }
    out
}

/// `[--shard`, `--inject K=V]...`, `--driver` → the flag's name; anything else → None.
fn flag_name(word: &str) -> Option<&str> {
    let w = word.trim_start_matches(['[', '(']);
    let w = w.split('=').next().unwrap_or(w);
    let w = w.trim_end_matches(['.', ']', ')', ',', ';', ':']);
    let long = w.strip_prefix("--").is_some_and(|n| {
        n.chars().next().is_some_and(|c| c.is_ascii_lowercase())
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    });
    let short = w.len() == 2 && w.starts_with('-') && w.chars().nth(1).is_some_and(|c| c.is_ascii_alphabetic());
    (long || short).then_some(w)
}

fn walk(doc: &Doc, inv: &Invocation, help: &dyn HelpSource, unchecked: &mut Vec<String>, out: &mut Vec<Problem>) {
    let mut path: Vec<String> = Vec::new();
    let mut spec = match help.help(&inv.program, &path) {
        Ok(spec) => spec,
        Err(why) => return note(unchecked, why),
    };
    let command = |path: &[String]| {
        std::iter::once(inv.program.as_str()).chain(path.iter().map(String::as_str)).collect::<Vec<_>>().join(" ")
    };
    let mut i = 0;
    while i < inv.words.len() {
        let (line, word) = &inv.words[i];
        i += 1;
        if let Some(flag) = flag_name(word) {
            match spec.flags.get(flag) {
                Some(&takes_value) => {
                    let next_is_value = inv.words.get(i).is_some_and(|(_, w)| flag_name(w).is_none());
                    if takes_value && !word.contains('=') && next_is_value {
                        i += 1;
                    }
                }
                None => out.push(Problem {
                    doc: doc.path.clone(),
                    line: *line,
                    claim: format!("`{} {flag}`", command(&path)),
                    why: format!("`{} --help` has no {flag}", command(&path)),
                }),
            }
            continue;
        }
        let bare = word.trim_matches(|c: char| matches!(c, '[' | ']' | '(' | ')' | '`' | ',' | ':' | ';' | '.'));
        let is_word = bare.chars().next().is_some_and(|c| c.is_ascii_lowercase())
            && bare.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if spec.requires_subcommand && !is_word {
            return; // a picture's box or a log line's placeholder, not a command line
        }
        if spec.subcommands.iter().any(|s| s == bare) {
            path.push(bare.to_string());
            spec = match help.help(&inv.program, &path) {
                Ok(spec) => spec,
                Err(why) => return note(unchecked, why),
            };
        } else if spec.requires_subcommand {
            out.push(Problem {
                doc: doc.path.clone(),
                line: *line,
                claim: format!("`{} {bare}`", command(&path)),
                why: format!("`{} --help` has no subcommand {bare}", command(&path)),
            });
            return;
        }
    }
}

fn note(unchecked: &mut Vec<String>, why: String) {
    if !unchecked.contains(&why) {
        unchecked.push(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_keep_quotes_and_stop_at_a_pipe() {
        assert_eq!(words("vhca-run suite --filter '^a b' | tee x", false), ["vhca-run", "suite", "--filter", "'^a b'"]);
        assert_eq!(words("[--driver native|sys]  run's", true), ["[--driver", "native|sys]", "run's"]);
    }

    #[test]
    fn flags_lose_their_brackets_and_values() {
        assert_eq!(flag_name("[--shard"), Some("--shard"));
        assert_eq!(flag_name("--inject=K=V]..."), Some("--inject"));
        assert_eq!(flag_name("-j"), Some("-j"));
        assert_eq!(flag_name("--"), None);
        assert_eq!(flag_name("-1"), None);
        assert_eq!(flag_name("native|sys]"), None);
    }

    #[test]
    fn a_program_given_as_an_option_value_starts_no_command() {
        let programs = ["vhca-run".to_string()];
        let w = words("cargo test --release -p vhca-run --test docs_true", false);
        assert!(start(&w, &programs, 1).is_none());
        let w = words("timeout 60 target/release/vhca-run --cold suite", false);
        assert_eq!(start(&w, &programs, 1).map(|i| i.words.len()), Some(2));
    }
}

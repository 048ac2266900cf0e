//! A doc as the checker reads it: its lines, which of them are fenced code and in which language, its prose
//! paragraphs and table rows, the inline code spans in them, and its sections, each with 1-based line numbers.

use std::io;
use std::path::Path;

pub struct Doc {
    /// Relative to the root, as problems name it.
    pub path: String,
    pub lines: Vec<String>,
    /// Per line: the info string of the fence it lies inside (`""` for a bare fence), None outside code.
    fence: Vec<Option<String>>,
}

/// Prose lines joined with '\n', so a claim or a code span that wraps is seen whole.
pub struct Paragraph {
    pub first_line: usize,
    pub text: String,
}

impl Paragraph {
    /// The 1-based line of the byte at `offset`.
    pub fn line_at(&self, offset: usize) -> usize {
        self.first_line + self.text[..offset].matches('\n').count()
    }
}

pub struct CodeLine<'a> {
    pub line: usize,
    pub text: &'a str,
    /// The fence's info string: `sh`, `text`, `toml`, or empty.
    pub info: &'a str,
}

impl Doc {
    pub fn load(root: &Path, path: &str) -> io::Result<Doc> {
        Ok(Doc::parse(path, &std::fs::read_to_string(root.join(path))?))
    }

    pub fn parse(path: &str, text: &str) -> Doc {
        let lines: Vec<String> = text.lines().map(str::to_string).collect();
        let mut fence = Vec::with_capacity(lines.len());
        let mut open: Option<String> = None;
        for line in &lines {
            let t = line.trim_start();
            if t.starts_with("```") || t.starts_with("~~~") {
                // The fence lines themselves count as outside code: they hold no claim.
                open = match open {
                    Some(_) => None,
                    None => Some(t[3..].trim().to_string()),
                };
                fence.push(None);
            } else {
                fence.push(open.clone());
            }
        }
        Doc { path: path.to_string(), lines, fence }
    }

    fn is_fence(&self, index: usize) -> bool {
        let t = self.lines[index].trim_start();
        t.starts_with("```") || t.starts_with("~~~")
    }

    pub fn code_lines(&self) -> impl Iterator<Item = CodeLine<'_>> {
        self.lines
            .iter()
            .zip(&self.fence)
            .enumerate()
            .filter_map(|(i, (text, info))| info.as_deref().map(|info| CodeLine { line: i + 1, text, info }))
    }

    /// Runs of prose lines between blank lines, headings and fences; a table row is a paragraph of its own.
    pub fn paragraphs(&self) -> Vec<Paragraph> {
        let mut out = Vec::new();
        let mut current: Option<Paragraph> = None;
        for (i, line) in self.lines.iter().enumerate() {
            let prose = self.fence[i].is_none() && !self.is_fence(i);
            let t = line.trim_start();
            let breaks = !prose || t.is_empty() || t.starts_with('#') || t.starts_with('|');
            if breaks {
                out.extend(current.take());
                if prose && (t.starts_with('|') || t.starts_with('#')) {
                    out.push(Paragraph { first_line: i + 1, text: line.clone() });
                }
                continue;
            }
            match &mut current {
                Some(p) => {
                    p.text.push('\n');
                    p.text.push_str(line);
                }
                None => current = Some(Paragraph { first_line: i + 1, text: line.clone() }),
            }
        }
        out.extend(current);
        out
    }

    /// Inline code spans (`like this`, or ``with ` inside``) of the prose, each with the line it starts on.
    pub fn code_spans(&self) -> Vec<(usize, String)> {
        let mut out = Vec::new();
        for p in self.paragraphs() {
            for (offset, span) in code_spans(&p.text) {
                out.push((p.line_at(offset), span.replace('\n', " ")));
            }
        }
        out
    }

    /// The lines (1-based, inclusive start, exclusive end) of the section whose heading is `title`, up to the next
    /// heading of the same or a higher level.
    pub fn section(&self, title: &str) -> Option<(usize, usize)> {
        let level_of = |line: &str| line.chars().take_while(|&c| c == '#').count();
        let start = self.lines.iter().enumerate().position(|(i, l)| {
            self.fence[i].is_none() && level_of(l) > 0 && l.trim_start_matches('#').trim() == title
        })?;
        let level = level_of(&self.lines[start]);
        let end = (start + 1..self.lines.len())
            .find(|&i| self.fence[i].is_none() && !self.is_fence(i) && (1..=level).contains(&level_of(&self.lines[i])))
            .unwrap_or(self.lines.len());
        Some((start + 1, end + 1))
    }
}

/// Byte offset and content of every code span in `text`: a run of n backticks up to the next run of exactly n.
fn code_spans(text: &str) -> Vec<(usize, &str)> {
    let bytes = text.as_bytes();
    let run_at = |i: usize| bytes[i..].iter().take_while(|&&b| b == b'`').count();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'`' {
            i += 1;
            continue;
        }
        let n = run_at(i);
        let open_end = i + n;
        let mut j = open_end;
        let mut close = None;
        while j < bytes.len() {
            if bytes[j] == b'`' {
                let m = run_at(j);
                if m == n {
                    close = Some(j);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match close {
            Some(c) => {
                out.push((i, text[open_end..c].trim()));
                i = c + n;
            }
            None => i = open_end,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_pair_runs_of_the_same_length() {
        let spans: Vec<&str> = code_spans("a `x` b ``y ` z`` c `open").into_iter().map(|(_, s)| s).collect();
        assert_eq!(spans, ["x", "y ` z"]);
    }
}

//! README.md's table of docs lists every docs/*.md, so a new page is never one nobody can find.

use super::markdown::Doc;
use super::Problem;

pub fn check(readme: &Doc, pages: &[String]) -> Vec<Problem> {
    let header = readme.lines.iter().position(|l| {
        let cells: Vec<&str> = l.trim().trim_matches('|').split('|').map(str::trim).collect();
        cells.first() == Some(&"doc")
    });
    let Some(header) = header else {
        return vec![Problem {
            doc: readme.path.clone(),
            line: 1,
            claim: "the docs table".into(),
            why: "no table whose first column is `doc`".into(),
        }];
    };
    let rows: Vec<&String> = readme.lines[header..].iter().take_while(|l| l.trim_start().starts_with('|')).collect();
    pages
        .iter()
        .filter(|page| !rows.iter().any(|row| row.contains(&format!("({page})")) || row.contains(&format!("`{page}`"))))
        .map(|page| Problem {
            doc: readme.path.clone(),
            line: header + 1,
            claim: format!("`{page}`"),
            why: "a page of docs/ the docs table does not list".into(),
        })
        .collect()
}

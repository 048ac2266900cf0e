//! Turns a byte span in a TOML text into what a person needs: the line, the column and the field's path
//! (`run[3].expect.on`). serde errors carry only a span; the path comes from toml_edit's spanned document.

use std::ops::Range;

use toml_edit::{ImDocument, Item, Table, Value};

/// 1-based line and column of byte `offset` (clamped to the text; columns count characters).
pub fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

/// The dotted path of the narrowest key or value whose span holds `offset`; `None` when the text does not parse
/// or nothing covers it (e.g. a comment).
pub fn field_path_at(text: &str, offset: usize) -> Option<String> {
    let doc = ImDocument::parse(text).ok()?;
    let mut best: Option<(usize, String)> = None;
    visit_table(doc.as_table(), "", offset, &mut best);
    best.map(|(_, path)| path)
}

type Best = Option<(usize, String)>;

fn consider(span: Option<Range<usize>>, offset: usize, path: &str, best: &mut Best) {
    let Some(span) = span else { return };
    // An empty span (end of input) still points at its start.
    let covers = span.start <= offset && (offset < span.end || span.start == span.end && offset == span.start);
    if !covers || path.is_empty() {
        return;
    }
    let width = span.end - span.start;
    if best.as_ref().is_none_or(|(w, _)| width <= *w) {
        *best = Some((width, path.to_string()));
    }
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

fn visit_table(table: &Table, prefix: &str, offset: usize, best: &mut Best) {
    // A standard table's span is its header; its keys live below it, so every child is visited regardless.
    consider(table.span(), offset, prefix, best);
    for (key, item) in table.iter() {
        let path = join(prefix, key);
        if let Some((k, _)) = table.get_key_value(key) {
            consider(k.span(), offset, &path, best);
        }
        visit_item(item, &path, offset, best);
    }
}

fn visit_item(item: &Item, path: &str, offset: usize, best: &mut Best) {
    match item {
        Item::None => {}
        Item::Value(v) => visit_value(v, path, offset, best),
        Item::Table(t) => visit_table(t, path, offset, best),
        Item::ArrayOfTables(a) => {
            for (i, t) in a.iter().enumerate() {
                visit_table(t, &format!("{path}[{i}]"), offset, best);
            }
        }
    }
}

fn visit_value(value: &Value, path: &str, offset: usize, best: &mut Best) {
    consider(value.span(), offset, path, best);
    match value {
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                visit_value(v, &format!("{path}[{i}]"), offset, best);
            }
        }
        Value::InlineTable(t) => {
            for (key, v) in t.iter() {
                let child = join(path, key);
                if let Some((k, _)) = t.get_key_value(key) {
                    consider(k.span(), offset, &child, best);
                }
                visit_value(v, &child, offset, best);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "name = \"s\"\n\n[[run]]\nname = \"a\"\n\n[[run]]\nname = \"b\"\nexpect = { off = \"pass\", on = \"bugcheck 0xZZ\" }\n[run.device]\ninject = [\"a=1\", \"b\"]\n";

    #[test]
    fn lines_and_columns() {
        assert_eq!(line_column("ab\ncd", 0), (1, 1));
        assert_eq!(line_column("ab\ncd", 4), (2, 2));
        assert_eq!(line_column("ab\ncd", 99), (2, 3));
        assert_eq!(line_column("é\nx", 1), (1, 1));
    }

    #[test]
    fn paths_name_the_narrowest_field() {
        let at = |needle: &str| DOC.find(needle).unwrap();
        assert_eq!(field_path_at(DOC, at("\"b\"")).as_deref(), Some("run[1].name"));
        assert_eq!(field_path_at(DOC, at("bugcheck 0xZZ")).as_deref(), Some("run[1].expect.on"));
        assert_eq!(field_path_at(DOC, at("\"b\"]")).as_deref(), Some("run[1].device.inject[1]"));
        assert_eq!(field_path_at(DOC, at("name = \"s\"")).as_deref(), Some("name"));
    }
}

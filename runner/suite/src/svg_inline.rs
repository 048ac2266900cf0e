//! A timeline SVG file made safe to inline in report.html: only the drawing elements and presentation attributes a
//! timeline uses are copied, every text re-escaped. The file is read back from an artifact folder (a downloaded
//! shard's, for a merged report), so it is not trusted to be the one `render_timeline` wrote.

use quick_xml::events::{BytesStart, Event};
use quick_xml::Reader;

use crate::xml_text::escape;

/// Elements that draw; anything else (script, foreignObject, a, use, style, image...) is left out with its content.
const ELEMENTS: &[&str] =
    &["svg", "g", "rect", "line", "polyline", "polygon", "circle", "path", "text", "tspan", "title"];

/// Geometry and presentation only: no event handlers, no links, no style sheets.
const ATTRIBUTES: &[&str] = &[
    "xmlns",
    "width",
    "height",
    "viewBox",
    "x",
    "y",
    "x1",
    "y1",
    "x2",
    "y2",
    "cx",
    "cy",
    "r",
    "d",
    "points",
    "transform",
    "fill",
    "stroke",
    "stroke-width",
    "stroke-dasharray",
    "opacity",
    "font-family",
    "font-size",
    "font-weight",
    "text-anchor",
    "class",
];

/// The SVG's markup cut down to the allowed elements and attributes, or `None` if it is not well-formed XML with an
/// `<svg>` root.
pub fn inline_svg(text: &str) -> Option<String> {
    let mut reader = Reader::from_str(text);
    let mut out = String::with_capacity(text.len());
    // Depth inside an element being left out: its whole subtree goes.
    let mut skipping = 0usize;
    let mut open: Vec<String> = Vec::new();
    let mut saw_root = false;
    loop {
        match reader.read_event().ok()? {
            Event::Start(e) => {
                let name = element_name(&e)?;
                if skipping > 0 || !allowed(&name, open.is_empty(), &mut saw_root)? {
                    skipping += 1;
                    continue;
                }
                out.push_str(&start_tag(&e, &name, false)?);
                open.push(name);
            }
            Event::Empty(e) => {
                let name = element_name(&e)?;
                if skipping == 0 && allowed(&name, open.is_empty(), &mut saw_root)? {
                    out.push_str(&start_tag(&e, &name, true)?);
                }
            }
            Event::End(_) => {
                if skipping > 0 {
                    skipping -= 1;
                } else {
                    out.push_str(&format!("</{}>", open.pop()?));
                }
            }
            Event::Text(t) if skipping == 0 && !open.is_empty() => out.push_str(&escape(&t.unescape().ok()?)),
            Event::Eof => break,
            // Comments, CDATA, processing instructions and doctypes carry nothing a timeline draws.
            _ => {}
        }
    }
    (saw_root && open.is_empty()).then_some(out)
}

fn element_name(e: &BytesStart) -> Option<String> {
    String::from_utf8(e.name().as_ref().to_vec()).ok()
}

/// Whether the element is copied; `None` (refuse the file) when the root is not one `<svg>`.
fn allowed(name: &str, at_top: bool, saw_root: &mut bool) -> Option<bool> {
    if !at_top {
        return Some(ELEMENTS.contains(&name));
    }
    if *saw_root || name != "svg" {
        return None;
    }
    *saw_root = true;
    Some(true)
}

fn start_tag(e: &BytesStart, name: &str, empty: bool) -> Option<String> {
    let mut tag = format!("<{name}");
    for a in e.attributes() {
        let a = a.ok()?;
        let key = std::str::from_utf8(a.key.as_ref()).ok()?;
        if ATTRIBUTES.contains(&key) {
            tag.push_str(&format!(" {key}=\"{}\"", escape(&a.unescape_value().ok()?)));
        }
    }
    tag.push_str(if empty { "/>" } else { ">" });
    Some(tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawing_survives_and_scripts_do_not() {
        let hostile = r#"<?xml version="1.0"?><!-- c --><svg xmlns="http://www.w3.org/2000/svg" onload="alert(1)" width="8">
<script>alert(2)</script><a href="javascript:alert(3)"><text>link</text></a>
<circle cx="1" cy="2" r="3" fill="red" onclick="x()" style="behavior:url(x)"><title>DMA fault: a &lt;b&gt; &amp;</title></circle>
<foreignObject><div xmlns="http://www.w3.org/1999/xhtml"><img src="x" onerror="alert(4)"/></div></foreignObject>
<text x="1">&lt;script&gt;</text></svg>"#;
        let svg = inline_svg(hostile).unwrap();
        for bad in
            ["script>", "onload", "onclick", "onerror", "href", "javascript", "style=", "foreignObject", "<img", "<a"]
        {
            assert!(!svg.contains(bad), "{bad} in {svg}");
        }
        assert!(svg.starts_with(r#"<svg xmlns="http://www.w3.org/2000/svg" width="8">"#), "{svg}");
        assert!(svg.contains(
            r#"<circle cx="1" cy="2" r="3" fill="red"><title>DMA fault: a &lt;b&gt; &amp;</title></circle>"#
        ));
        assert!(svg.contains("<text x=\"1\">&lt;script&gt;</text>"));
        assert!(svg.ends_with("</svg>"));
    }

    #[test]
    fn not_an_svg_is_refused() {
        assert_eq!(inline_svg("<html><body/></html>"), None);
        assert_eq!(inline_svg("<svg><line></svg>"), None);
        assert_eq!(inline_svg("<svg/><svg/>"), None);
        assert_eq!(inline_svg(""), None);
        assert!(inline_svg("<svg/>").is_some());
    }
}

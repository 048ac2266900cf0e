//! Text made safe for XML 1.0: markup characters escaped and the control characters XML forbids replaced.
//! Reasons and names can carry serial output, which may hold any byte the guest printed.

use std::borrow::Cow;

/// Replaces the characters XML 1.0 cannot carry at all (C0 controls other than tab, LF, CR; U+FFFE, U+FFFF).
pub fn xml_safe(text: &str) -> Cow<'_, str> {
    let bad = |c: char| (c < ' ' && !matches!(c, '\t' | '\n' | '\r')) || matches!(c, '\u{FFFE}' | '\u{FFFF}');
    if text.chars().any(bad) {
        Cow::Owned(text.chars().map(|c| if bad(c) { '\u{FFFD}' } else { c }).collect())
    } else {
        Cow::Borrowed(text)
    }
}

/// Escaped for element text and attribute values alike.
pub fn escape(text: &str) -> String {
    quick_xml::escape::escape(xml_safe(text).as_ref()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_replaces_controls() {
        assert_eq!(escape("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&apos;");
        assert_eq!(escape("bell\u{7}\ttab"), "bell\u{FFFD}\ttab");
        assert!(matches!(xml_safe("plain"), Cow::Borrowed(_)));
    }
}

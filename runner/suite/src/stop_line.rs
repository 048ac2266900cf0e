//! A Windows-style bugcheck: the `*** STOP: 0x000000E6 (p1,p2,p3,p4)` line the NT model prints, and its name.
//! Parsing never trusts the serial text: hex that does not fit or a malformed list yields no bugcheck.

use serde::{Serialize, Serializer};
pub use vhca_ntapi::bugcheck_name;

/// A bugcheck the guest reported, on serial or through QMP GUEST_PANICKED (Hyper-V crash MSRs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Bugcheck {
    #[serde(serialize_with = "hex_u32")]
    pub code: u32,
    /// Up to four parameters, in order; Windows always prints four.
    #[serde(serialize_with = "hex_u64s")]
    pub params: Vec<u64>,
    /// The symbolic name (`DRIVER_VERIFIER_DMA_VIOLATION`): as printed, else from the table of known codes.
    pub name: Option<String>,
}

impl Bugcheck {
    pub fn param1(&self) -> Option<u64> {
        self.params.first().copied()
    }

    /// The line in Windows' form, as the NT model prints it and `parse_bugcheck` reads it back:
    /// `*** STOP: 0x000000E6 (0x0000000000000026,…) NAME`. A Windows guest prints no such line on its serial port;
    /// the runner writes this one for a bugcheck QEMU reported through the Hyper-V crash MSRs, so both guests'
    /// bugchecks read the same in logs and reports.
    pub fn stop_line(&self) -> String {
        let params: Vec<String> = self.params.iter().map(|p| format!("{p:#018X}").replacen("0X", "0x", 1)).collect();
        let mut line = format!("{STOP_MARK} 0x{:08X} ({})", self.code, params.join(","));
        if let Some(name) = &self.name {
            line.push(' ');
            line.push_str(name);
        }
        line
    }
}

impl std::fmt::Display for Bugcheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "bugcheck {:#X}", self.code)?;
        if !self.params.is_empty() {
            let params: Vec<String> = self.params.iter().map(|p| format!("{p:#X}")).collect();
            write!(f, " ({})", params.join(", "))?;
        }
        if let Some(name) = &self.name {
            write!(f, " {name}")?;
        }
        Ok(())
    }
}

const STOP_MARK: &str = "*** STOP:";

/// Parses one serial line holding a STOP message; `None` if the line has none or it is malformed.
/// A name may follow the closing parenthesis on the same line; `scan_serial` also looks at the next line.
pub fn parse_bugcheck(line: &str) -> Option<Bugcheck> {
    let at = line.find(STOP_MARK)?;
    let rest = line[at + STOP_MARK.len()..].trim_start();
    let (code_text, rest) = split_token(rest);
    let code = u32::try_from(parse_hex(code_text)?).ok()?;
    let rest = rest.trim_start();
    let (params, tail) = match rest.strip_prefix('(') {
        Some(inner) => {
            let close = inner.find(')')?;
            let list = &inner[..close];
            let params: Option<Vec<u64>> = list.split(',').map(|p| parse_hex(p.trim())).collect();
            let params = params?;
            if params.len() > 4 {
                return None;
            }
            (params, &inner[close + 1..])
        }
        None => (Vec::new(), rest),
    };
    let name = symbolic_name(tail.trim()).map(str::to_string).or_else(|| bugcheck_name(code).map(str::to_string));
    Some(Bugcheck { code, params, name })
}

/// The symbolic name if `text` is one (`UPPER_SNAKE_CASE`, at least 3 characters).
pub(crate) fn symbolic_name(text: &str) -> Option<&str> {
    let word = text.split_whitespace().next()?;
    let ok = word.len() >= 3
        && word.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        && word.chars().next().is_some_and(|c| c.is_ascii_uppercase());
    ok.then_some(word)
}

fn split_token(text: &str) -> (&str, &str) {
    let end = text.find(|c: char| c.is_whitespace() || c == '(').unwrap_or(text.len());
    text.split_at(end)
}

/// `0x`-prefixed hex that fits in 64 bits.
pub(crate) fn parse_hex(text: &str) -> Option<u64> {
    let digits = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X"))?;
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    // Leading zeros are common (0x000000E6); only significant digits count towards overflow.
    u64::from_str_radix(digits, 16).ok()
}

fn hex_u32<S: Serializer>(value: &u32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{value:#X}"))
}

fn hex_u64s<S: Serializer>(values: &[u64], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(values.iter().map(|v| format!("{v:#X}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_form_with_name_on_the_line() {
        let b = parse_bugcheck(
            "*** STOP: 0x000000E6 (0x0000000000000026,0x0000000000001000,0x0000000000000000,0x0000000000000000) \
             DRIVER_VERIFIER_DMA_VIOLATION",
        )
        .unwrap();
        assert_eq!(b.code, 0xE6);
        assert_eq!(b.params, vec![0x26, 0x1000, 0, 0]);
        assert_eq!(b.name.as_deref(), Some("DRIVER_VERIFIER_DMA_VIOLATION"));
        assert_eq!(b.param1(), Some(0x26));
    }

    #[test]
    fn prefix_and_known_name_fallback() {
        let b = parse_bugcheck("[   3.2] vhca-guest: *** STOP: 0x000000C4 (0x33,0x1,0x0,0x0)\r").unwrap();
        assert_eq!(b.code, 0xC4);
        assert_eq!(b.params[0], 0x33);
        assert_eq!(b.name.as_deref(), Some("DRIVER_VERIFIER_DETECTED_VIOLATION"));
        let unknown = parse_bugcheck("*** STOP: 0x0000ABCD (0x1,0x2,0x3,0x4)").unwrap();
        assert_eq!(unknown.name, None);
        assert_eq!(unknown.to_string(), "bugcheck 0xABCD (0x1, 0x2, 0x3, 0x4)");
    }

    #[test]
    fn malformed_stop_lines_are_refused() {
        for line in [
            "no stop here",
            "*** STOP: E6 (0x1,0x2,0x3,0x4)",
            "*** STOP: 0x1000000E6 (0x1,0x2,0x3,0x4)",
            "*** STOP: 0xE6 (0x1,0x2,0x3,0x4",
            "*** STOP: 0xE6 (0x1,zz,0x3,0x4)",
            "*** STOP: 0xE6 (0x1,0x2,0x3,0x4,0x5)",
            "*** STOP: 0xE6 (0x11111111111111111,0x2,0x3,0x4)",
        ] {
            assert_eq!(parse_bugcheck(line), None, "{line}");
        }
    }

    #[test]
    fn stop_line_is_windows_form_and_reads_back() {
        let b = Bugcheck { code: 0xE6, params: vec![0x26, 0xFFFF_F803_1234_5678, 0, 1], name: None };
        let line = b.stop_line();
        assert_eq!(
            line,
            "*** STOP: 0x000000E6 (0x0000000000000026,0xFFFFF80312345678,0x0000000000000000,0x0000000000000001)"
        );
        let back = parse_bugcheck(&line).unwrap();
        assert_eq!((back.code, &back.params), (0xE6, &b.params));
        assert_eq!(back.name.as_deref(), Some("DRIVER_VERIFIER_DMA_VIOLATION"));
        assert!(back.stop_line().ends_with(") DRIVER_VERIFIER_DMA_VIOLATION"));
    }

    #[test]
    fn serialises_codes_as_hex_strings() {
        let b = parse_bugcheck("*** STOP: 0x000000E6 (0x26,0x0,0x0,0x0)").unwrap();
        let json = serde_json::to_value(&b).unwrap();
        assert_eq!(json["code"], "0xE6");
        assert_eq!(json["params"][0], "0x26");
    }
}

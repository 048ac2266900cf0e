//! Reads a guest's serial output: the `VHCA-RESULT {json}` line, Windows-style STOP lines and Linux panics.
//! Serial text is untrusted and may be cut mid-line by a kill; every parser tolerates junk and never panics.

use serde::Serialize;

use crate::stop_line::{parse_bugcheck, symbolic_name, Bugcheck};

/// The marker the guest program prints before its JSON result.
pub const RESULT_MARK: &str = "VHCA-RESULT";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PanicKind {
    /// `Kernel panic - not syncing: ...`
    KernelPanic,
    /// `BUG: ...`
    Bug,
    /// `Oops: ...`
    Oops,
    /// `general protection fault ...`
    GeneralProtection,
}

/// A Linux kernel panic or oops line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LinuxPanic {
    pub kind: PanicKind,
    /// The line without its printk prefixes.
    pub message: String,
}

/// A `VHCA-RESULT` line: its 1-based line number and the JSON object, or why it did not parse.
#[derive(Debug, Clone, PartialEq)]
pub struct ResultLine {
    pub line: usize,
    pub parsed: Result<serde_json::Value, String>,
}

/// Everything the serial log says about a run, in order of appearance.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SerialFindings {
    pub results: Vec<ResultLine>,
    pub bugchecks: Vec<Bugcheck>,
    pub panics: Vec<LinuxPanic>,
}

/// `None` if the line is not a result line; else the JSON object after the marker, or why it is not one.
pub fn parse_result_line(line: &str) -> Option<Result<serde_json::Value, String>> {
    let at = line.find(RESULT_MARK)?;
    let json = line[at + RESULT_MARK.len()..].trim();
    Some(match serde_json::from_str::<serde_json::Value>(json) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err(format!("{RESULT_MARK} is not followed by a JSON object: {}", clip(json, 120))),
        Err(e) => Err(format!("{RESULT_MARK} JSON does not parse ({e}): {}", clip(json, 120))),
    })
}

/// Drops the printk decorations a console line may carry: `<6>`, `[    1.234567]`, `[    T1]`.
fn strip_printk_prefix(mut line: &str) -> &str {
    loop {
        line = line.trim_start();
        let inner_end = match line.as_bytes().first() {
            Some(b'<') => line.find('>'),
            Some(b'[') => line.find(']'),
            _ => None,
        };
        let Some(end) = inner_end else { return line };
        let inner = &line[1..end];
        let decoration = !inner.is_empty()
            && inner.chars().all(|c| c.is_ascii_digit() || c == '.' || c == ' ' || c == 'T' || c == 'C');
        if !decoration {
            return line;
        }
        line = &line[end + 1..];
    }
}

/// A Linux panic or oops, if this console line starts one.
pub fn parse_linux_panic(line: &str) -> Option<LinuxPanic> {
    let text = strip_printk_prefix(line).trim_end();
    let kind = if text.contains("Kernel panic - not syncing") {
        PanicKind::KernelPanic
    } else if text.starts_with("BUG:") {
        PanicKind::Bug
    } else if text.starts_with("Oops:") {
        PanicKind::Oops
    } else if text.starts_with("general protection fault") {
        PanicKind::GeneralProtection
    } else {
        return None;
    };
    Some(LinuxPanic { kind, message: clip(text, 300) })
}

/// Scans a whole serial log. A STOP line's name may also stand alone on the next non-empty line.
pub fn scan_serial(text: &str) -> SerialFindings {
    let mut found = SerialFindings::default();
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if let Some(parsed) = parse_result_line(line) {
            // The kernel's printk can cut into the guest's result line: a panic inside a result that does not parse
            // is still a panic (found by fuzzing, fuzz/regressions/serial_console).
            if parsed.is_err() {
                found.panics.extend(parse_linux_panic(line));
            }
            found.results.push(ResultLine { line: i + 1, parsed });
        } else if let Some(mut bugcheck) = parse_bugcheck(line) {
            let next = lines.iter().skip(i + 1).map(|l| strip_printk_prefix(l).trim()).find(|l| !l.is_empty());
            if let Some(name) = next.filter(|l| !l.contains(' ')).and_then(symbolic_name) {
                bugcheck.name = Some(name.to_string());
            }
            found.bugchecks.push(bugcheck);
        } else if let Some(panic) = parse_linux_panic(line) {
            found.panics.push(panic);
        }
    }
    found
}

/// At most `max` characters of `text`, marked when cut; messages built from guest text stay one readable line.
pub(crate) fn clip(text: &str, max: usize) -> String {
    let one_line: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    match one_line.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &one_line[..at]),
        None => one_line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines() {
        let ok = parse_result_line("VHCA-RESULT {\"ok\":true,\"scenario\":\"smoke\"}\r").unwrap().unwrap();
        assert_eq!(ok["ok"], true);
        assert!(parse_result_line("[ 1.0] VHCA-RESULT {\"ok\":fal").unwrap().is_err());
        assert!(parse_result_line("VHCA-RESULT [1,2]").unwrap().is_err());
        assert_eq!(parse_result_line("nothing to see"), None);
    }

    #[test]
    fn a_panic_cutting_into_the_result_line_is_still_a_panic() {
        let cut = "VHCA-RESULT {\"scenario\":\"verbs\",\"okKernel panic - not syncing: Fatal exception\n";
        let found = scan_serial(cut);
        assert_eq!(found.results.len(), 1);
        assert!(found.results[0].parsed.is_err());
        assert_eq!(found.panics.len(), 1);
        assert_eq!(found.panics[0].kind, PanicKind::KernelPanic);
        let quoted = "VHCA-RESULT {\"ok\":false,\"error\":\"Kernel panic - not syncing in the log\"}\n";
        assert!(scan_serial(quoted).panics.is_empty(), "a result that parses is only a result");
    }

    #[test]
    fn linux_panics_and_look_alikes() {
        let cases = [
            ("[    2.345678] Kernel panic - not syncing: Attempted to kill init!", Some(PanicKind::KernelPanic)),
            ("<1>[    1.0] BUG: kernel NULL pointer dereference, address: 0000000000000008", Some(PanicKind::Bug)),
            ("[    1.0][    T1] Oops: 0002 [#1] PREEMPT SMP NOPTI", Some(PanicKind::Oops)),
            (
                "general protection fault, probably for non-canonical address 0xdead: 0000 [#1]",
                Some(PanicKind::GeneralProtection),
            ),
            ("vhca-guest: DEBUG: mapping 4 pages", None),
            ("[ 1.0] [vhca] saw BUG: in a message", None),
            ("", None),
        ];
        for (line, want) in cases {
            assert_eq!(parse_linux_panic(line).map(|p| p.kind), want, "{line}");
        }
        let p = parse_linux_panic("[    2.3] Kernel panic - not syncing: Fatal exception").unwrap();
        assert_eq!(p.message, "Kernel panic - not syncing: Fatal exception");
    }

    #[test]
    fn scan_finds_everything_in_order_and_the_name_on_the_next_line() {
        let log = "booting\n[ 0.1] vhca: start\n*** STOP: 0x000000E6 (0x0000000000000026,0x0,0x0,0x0)\n\nDRIVER_VERIFIER_DMA_VIOLATION\n\
                   VHCA-RESULT {\"ok\":false,\"error\":\"x\"}\nKernel panic - not syncing: done\n";
        let found = scan_serial(log);
        assert_eq!(found.bugchecks.len(), 1);
        assert_eq!(found.bugchecks[0].params[0], 0x26);
        assert_eq!(found.bugchecks[0].name.as_deref(), Some("DRIVER_VERIFIER_DMA_VIOLATION"));
        assert_eq!(found.results.len(), 1);
        assert_eq!(found.results[0].line, 6);
        assert_eq!(found.panics.len(), 1);
    }

    #[test]
    fn clip_keeps_lines_short_and_single() {
        assert_eq!(clip("a\nb", 10), "a b");
        assert_eq!(clip("ééééé", 3), "ééé…");
    }
}

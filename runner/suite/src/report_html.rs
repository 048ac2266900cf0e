//! report.html: the suite's verdicts as one self-contained page to open from a downloaded CI artifact (file://, no
//! server, nothing fetched): the verdict table with a failed-only filter, then for each failed run its STOP line
//! with the parameters named, its reproducer, its timeline inline and relative links to its artifact files.
//! Rendered from report.json's document, so a merged report gets the same page; every string from a run is escaped.

use std::collections::HashMap;
use std::fmt::Write;

use serde::Deserialize;
use serde_json::Value;

use crate::bugcheck_params::bugcheck_meaning;
use crate::expect::{Expected, Param};
use crate::stop_line::{bugcheck_name, parse_hex, Bugcheck};
use crate::svg_inline::inline_svg;
use crate::xml_text::escape;

/// One run's artifact folder as the page shows it. The caller reads the folder (`report_page`); this module only
/// renders.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunArtifacts {
    /// The folder relative to report.html, as path segments (`["..", "shard-1", "smoke", "verifier-off"]`).
    pub folder: Vec<String>,
    /// The folder's files, name and size in bytes, in the order to list them.
    pub files: Vec<(String, u64)>,
    /// Its timeline.svg as read, if it has one.
    pub timeline_svg: Option<String>,
}

/// The parts of report.json the page shows. Lenient on purpose: a field an older report lacks shows as empty
/// instead of costing the whole page.
#[derive(Debug, Deserialize)]
struct ReportDoc {
    suite: String,
    #[serde(default)]
    source: String,
    runs: Vec<RunDoc>,
    totals: TotalsDoc,
}

#[derive(Debug, Deserialize)]
struct TotalsDoc {
    runs: usize,
    passed: usize,
    failed: usize,
    #[serde(default)]
    run_seconds: f64,
    #[serde(default)]
    wall_seconds: f64,
    /// Set by `report merge`.
    #[serde(default)]
    shards: Option<usize>,
}

#[derive(Debug, Deserialize)]
struct RunDoc {
    name: String,
    #[serde(default)]
    mode: String,
    /// The driver personality (`native`, `sys`); the key stays `driver` in the report.
    #[serde(default, alias = "personality")]
    driver: String,
    #[serde(default)]
    expected: String,
    #[serde(default)]
    actual: Value,
    #[serde(default)]
    actual_text: String,
    outcome: OutcomeDoc,
    #[serde(default)]
    notes: Vec<String>,
    #[serde(default)]
    seconds: f64,
    #[serde(default)]
    accelerator: String,
    #[serde(default)]
    path: String,
    #[serde(default)]
    reproducer: Option<String>,
}

#[derive(Debug, Deserialize)]
struct OutcomeDoc {
    result: String,
    #[serde(default)]
    reason: Option<String>,
}

impl RunDoc {
    fn failed(&self) -> bool {
        self.outcome.result != "pass"
    }

    /// The bugcheck the run ended in, read back from the report's hex strings.
    fn bugcheck(&self) -> Option<Bugcheck> {
        if self.actual.get("kind")?.as_str()? != "bugcheck" {
            return None;
        }
        let code = u32::try_from(parse_hex(self.actual.get("code")?.as_str()?)?).ok()?;
        let params: Option<Vec<u64>> =
            self.actual.get("params")?.as_array()?.iter().map(|p| parse_hex(p.as_str()?)).collect();
        let name = self.actual.get("name").and_then(Value::as_str).map(str::to_string);
        Some(Bugcheck { code, params: params?, name })
    }
}

/// Renders the page from a JSON report (`SuiteReport::to_json`'s or `merge_json`'s document). `artifacts` is keyed
/// by run name; a run without an entry is shown without links or timeline.
pub fn render_report_html(
    report: &Value,
    artifacts: &HashMap<String, RunArtifacts>,
) -> Result<String, serde_json::Error> {
    let doc = ReportDoc::deserialize(report)?;
    let t = &doc.totals;
    let mut page = String::new();
    let title = format!("{}: {} of {} runs failed", doc.suite, t.failed, t.runs);
    let _ = write!(
        page,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{} — vhca-run</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        escape(&title)
    );
    let _ = writeln!(page, "<header>\n<h1>Suite <span class=\"suite\">{}</span></h1>", escape(&doc.suite));
    let shards = t.shards.map(|n| format!(" from {n} shards")).unwrap_or_default();
    let _ = writeln!(
        page,
        "<p class=\"totals\"><strong>{} runs</strong>{shards}: <span class=\"n-pass\">{} passed</span>, \
         <span class=\"n-fail\">{} failed</span>; {:.2} s of runs in {:.2} s wall.</p>",
        t.runs, t.passed, t.failed, t.run_seconds, t.wall_seconds
    );
    if !doc.source.is_empty() {
        let _ = writeln!(page, "<p class=\"source\">Suite file: <code>{}</code></p>", escape(&doc.source));
    }
    page.push_str("</header>\n");
    verdict_table(&mut page, &doc.runs);
    let failed: Vec<(usize, &RunDoc)> = doc.runs.iter().enumerate().filter(|(_, r)| r.failed()).collect();
    if !failed.is_empty() {
        page.push_str("<h2 class=\"failures\">Failed runs</h2>\n");
    }
    for (i, run) in failed {
        failure_section(&mut page, i, run, artifacts.get(&run.name));
    }
    let _ = write!(page, "<script>{SCRIPT}</script>\n</body>\n</html>\n");
    Ok(page)
}

fn verdict_table(page: &mut String, runs: &[RunDoc]) {
    page.push_str(
        "<p class=\"filter\"><label><input type=\"checkbox\" id=\"only-failed\"> only failed runs</label> \
         <span id=\"shown\"></span></p>\n<table id=\"verdicts\">\n<thead><tr><th>run</th><th>personality</th>\
         <th>verifier</th><th>verdict</th><th class=\"num\">time (s)</th></tr></thead>\n<tbody>\n",
    );
    for (i, run) in runs.iter().enumerate() {
        // The outcome attribute takes one of two fixed words, never the report's own string.
        let outcome = if run.failed() { "fail" } else { "pass" };
        let name =
            if run.failed() { format!("<a href=\"#run-{i}\">{}</a>", escape(&run.name)) } else { escape(&run.name) };
        let verdict = match (&run.outcome.reason, run.failed()) {
            (_, false) => format!("<span class=\"badge pass\">pass</span> {}", escape(&run.actual_text)),
            (Some(reason), true) => format!("<span class=\"badge fail\">FAIL</span> {}", escape(reason)),
            (None, true) => format!("<span class=\"badge fail\">FAIL</span> {}", escape(&run.actual_text)),
        };
        let _ = writeln!(
            page,
            "<tr class=\"run {outcome}\" data-outcome=\"{outcome}\"><td class=\"name\">{name}</td><td>{}</td>\
             <td>{}</td><td class=\"verdict\">{verdict}</td><td class=\"num\">{:.2}</td></tr>",
            escape(&run.driver),
            escape(&run.mode),
            run.seconds
        );
    }
    page.push_str("</tbody>\n</table>\n");
}

fn failure_section(page: &mut String, i: usize, run: &RunDoc, artifacts: Option<&RunArtifacts>) {
    let _ = writeln!(
        page,
        "<section class=\"failure\" id=\"run-{i}\">\n<h3><a href=\"#run-{i}\">{}</a></h3>\n<dl class=\"facts\">",
        escape(&run.name)
    );
    let mut fact = |term: &str, html: String| {
        let _ = writeln!(page, "<dt>{term}</dt><dd>{html}</dd>");
    };
    fact("expected", format!("<code>{}</code>", escape(&run.expected)));
    fact("actual", format!("<code>{}</code>", escape(&run.actual_text)));
    if let Some(reason) = &run.outcome.reason {
        fact("reason", escape(reason));
    }
    if !run.notes.is_empty() {
        let items: String = run.notes.iter().map(|n| format!("<li>{}</li>", escape(n))).collect();
        fact("notes", format!("<ul>{items}</ul>"));
    }
    let ran =
        [("personality", &run.driver), ("verifier", &run.mode), ("accelerator", &run.accelerator), ("boot", &run.path)]
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| format!("{k} {}", escape(v)))
            .collect::<Vec<_>>()
            .join(", ");
    fact("ran", format!("{ran}; {:.2} s", run.seconds));
    page.push_str("</dl>\n");
    stop_details(page, run);
    if let Some(cmd) = &run.reproducer {
        let _ = writeln!(page, "<h4>Reproduce</h4>\n<pre class=\"reproducer\"><code>{}</code></pre>", escape(cmd));
    }
    page.push_str("<h4>Timeline</h4>\n");
    match artifacts.and_then(|a| a.timeline_svg.as_deref()) {
        Some(text) => match inline_svg(text) {
            Some(svg) => {
                let _ = writeln!(page, "<figure class=\"timeline\">{svg}</figure>");
            }
            None => page.push_str("<p class=\"missing\">timeline.svg is not a well-formed SVG: open it below.</p>\n"),
        },
        None => page.push_str("<p class=\"missing\">No timeline.svg in the run's artifact folder.</p>\n"),
    }
    page.push_str("<h4>Artifacts</h4>\n");
    match artifacts {
        Some(a) => {
            let folder = href(&a.folder, None);
            let _ = writeln!(
                page,
                "<p class=\"folder\">Folder: <a href=\"{folder}/\">{}</a></p>\n<ul class=\"artifacts\">",
                escape(&a.folder.join("/"))
            );
            for (file, bytes) in &a.files {
                let _ = writeln!(
                    page,
                    "<li><a href=\"{}\">{}</a> <span class=\"size\">{}</span></li>",
                    href(&a.folder, Some(file)),
                    escape(file),
                    size(*bytes)
                );
            }
            page.push_str("</ul>\n");
        }
        None => page.push_str("<p class=\"missing\">No artifact folder for this run beside the report.</p>\n"),
    }
    page.push_str("</section>\n");
}

/// The STOP line and a table naming each parameter, with what the suite expected beside what came.
fn stop_details(page: &mut String, run: &RunDoc) {
    let actual = run.bugcheck();
    let expected = match Expected::parse(&run.expected) {
        Ok(Expected::Bugcheck { code, params }) => Some((code, params)),
        _ => None,
    };
    let Some(code) = actual.as_ref().map(|b| b.code).or(expected.map(|e| e.0)) else {
        return;
    };
    page.push_str("<h4>STOP</h4>\n");
    match &actual {
        Some(b) => {
            let _ = writeln!(page, "<pre class=\"stop\">{}</pre>", escape(&b.stop_line()));
        }
        None => {
            let _ = writeln!(
                page,
                "<p class=\"no-stop\">No STOP line: the run ended in <code>{}</code>.</p>",
                escape(&run.actual_text)
            );
        }
    }
    // Name and meaning from what came, else from what was expected.
    let p1 = match (&actual, expected) {
        (Some(b), _) => b.param1(),
        (None, Some((_, [Param::Is(v), ..]))) => Some(v),
        _ => None,
    };
    let meaning = bugcheck_meaning(code, p1);
    let name = actual.as_ref().and_then(|b| b.name.clone()).or_else(|| bugcheck_name(code).map(str::to_string));
    let mut heading = format!("<span class=\"code\">{code:#X}</span>");
    if let Some(name) = name {
        let _ = write!(heading, " <span class=\"code-name\">{}</span>", escape(&name));
    }
    if let (Some(rule), Some(p1)) = (meaning.rule, p1) {
        let _ = write!(heading, " — rule {p1:#X}: <span class=\"rule\">{}</span>", escape(rule));
    }
    let _ = writeln!(page, "<p class=\"bugcheck\">{heading}</p>");
    let expected_code_differs = expected.is_some_and(|(c, _)| actual.as_ref().is_some_and(|b| b.code != c));
    page.push_str(
        "<table class=\"params\">\n<thead><tr><th></th><th>value</th><th>expected</th><th>meaning</th></tr></thead>\n<tbody>\n",
    );
    for (k, what) in meaning.params.iter().enumerate() {
        let got = actual.as_ref().and_then(|b| b.params.get(k).copied());
        let want = expected.filter(|_| !expected_code_differs).map(|(_, p)| p[k]);
        let differs = matches!((got, want), (Some(g), Some(w)) if !w.matches(g)) || (got.is_none() && actual.is_some());
        let _ = writeln!(
            page,
            "<tr{}><th>P{}</th><td><code>{}</code></td><td><code>{}</code></td><td>{}</td></tr>",
            if differs { " class=\"differs\"" } else { "" },
            k + 1,
            got.map_or("—".to_string(), |g| format!("{g:#X}")),
            want.map_or("—".to_string(), |w| w.to_string()),
            what.map_or_else(String::new, escape)
        );
    }
    page.push_str("</tbody>\n</table>\n");
    if expected_code_differs {
        let _ = writeln!(
            page,
            "<p class=\"note\">The suite expected another code: <code>{}</code>.</p>",
            escape(&run.expected)
        );
    }
}

/// A relative link: each path segment percent-encoded, so no name can end the attribute, start a scheme
/// (`javascript:` becomes `javascript%3A`) or add a query or fragment.
fn href(folder: &[String], file: Option<&str>) -> String {
    let segments: Vec<String> = folder.iter().map(String::as_str).chain(file).map(percent_encode).collect();
    if segments.is_empty() {
        ".".to_string()
    } else {
        segments.join("/")
    }
}

fn percent_encode(segment: &str) -> String {
    if segment == ".." || segment == "." {
        return segment.to_string();
    }
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

fn size(bytes: u64) -> String {
    match bytes {
        0..1024 => format!("{bytes} B"),
        1024..1_048_576 => format!("{:.1} KiB", bytes as f64 / 1024.0),
        _ => format!("{:.1} MiB", bytes as f64 / 1_048_576.0),
    }
}

/// Nothing leaves the page: no fetches, fonts, frames or images from anywhere; only its own style and script run.
/// Even a string the escaping missed could then neither load nor send anything.
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:";

const STYLE: &str = "
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; margin: 0 0 .2em; } h2 { margin-top: 1.6em; } h3 { margin: 0 0 .5em; font-size: 1.15em; }
h4 { margin: 1em 0 .3em; font-size: 1em; color: #555; }
code, pre { font: 12.5px/1.4 ui-monospace, monospace; }
.totals .n-fail { color: #b00020; font-weight: 600; } .totals .n-pass { color: #1b5e20; }
.filter { margin: 1em 0 .4em; } #shown { color: #666; margin-left: 1em; }
table { border-collapse: collapse; }
#verdicts { width: 100%; }
#verdicts th, #verdicts td { text-align: left; padding: .3em .6em; border-bottom: 1px solid #ddd; vertical-align: top; }
#verdicts thead th { background: #f3f3f3; position: sticky; top: 0; }
#verdicts tr.fail td:first-child { border-left: 4px solid #b00020; } #verdicts tr.pass td:first-child { border-left: 4px solid #2e7d32; }
#verdicts td.name, #verdicts th { white-space: nowrap; } #verdicts td.verdict { word-break: break-word; }
.num { text-align: right !important; font-variant-numeric: tabular-nums; }
.badge { display: inline-block; min-width: 3em; text-align: center; border-radius: 3px; padding: 0 .3em; font-weight: 600; font-size: .85em; }
.badge.pass { background: #e8f5e9; color: #1b5e20; } .badge.fail { background: #fde7ea; color: #b00020; }
section.failure { border: 1px solid #e3b6bd; border-left: 4px solid #b00020; border-radius: 4px; padding: .8em 1em; margin: 1em 0; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: .2em 1em; margin: 0; }
dl.facts dt { color: #555; } dl.facts dd { margin: 0; word-break: break-word; } dl.facts ul { margin: 0; padding-left: 1.2em; }
pre { background: #f6f6f6; padding: .5em .7em; border-radius: 3px; overflow-x: auto; white-space: pre-wrap; word-break: break-all; }
pre.stop { background: #fff0f0; color: #7f0000; }
pre.reproducer code { user-select: all; }
p.bugcheck .code-name { font-weight: 600; } p.bugcheck .rule { font-style: italic; }
table.params th, table.params td { padding: .15em .8em .15em 0; text-align: left; border-bottom: 1px solid #eee; }
table.params tr.differs td code { color: #b00020; font-weight: 600; }
figure.timeline { margin: .3em 0; } figure.timeline svg { max-width: 100%; height: auto; border: 1px solid #ddd; }
ul.artifacts { columns: 3 16em; margin: .3em 0; } .size { color: #777; font-size: .9em; }
.missing, .note, .no-stop { color: #666; }
";

/// The failed-only filter: rows get `hidden`, so the state also shows in the DOM (and a test reads it there);
/// `#failed` in the address opens the page filtered.
const SCRIPT: &str = "
(function () {
  var box = document.getElementById('only-failed');
  var rows = Array.prototype.slice.call(document.querySelectorAll('#verdicts tbody tr'));
  function apply() {
    var shown = 0;
    rows.forEach(function (row) {
      row.hidden = box.checked && row.dataset.outcome !== 'fail';
      if (!row.hidden) shown++;
    });
    document.getElementById('shown').textContent = 'showing ' + shown + ' of ' + rows.length + ' runs';
    document.body.dataset.filter = box.checked ? 'failed' : 'all';
  }
  if (location.hash === '#failed') box.checked = true;
  box.addEventListener('change', apply);
  apply();
})();
";

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const HOSTILE: &str = "<script>alert(1)</script><img src=x onerror=alert(2)>\"'&";

    fn run(name: &str, result: &str, reason: Option<&str>) -> Value {
        json!({
            "name": name, "run": name, "mode": "on", "driver": "native", "expected": "pass",
            "actual": {"kind": "guest-failed", "error": HOSTILE}, "actual_text": format!("guest-failed: {HOSTILE}"),
            "outcome": {"result": result, "reason": reason}, "notes": [HOSTILE], "seconds": 1.5,
            "accelerator": "tcg", "path": "cold", "reproducer": format!("vhca-run suite --filter '{HOSTILE}'"),
        })
    }

    fn report(runs: Vec<Value>) -> Value {
        let failed = runs.iter().filter(|r| r["outcome"]["result"] != "pass").count();
        json!({"suite": HOSTILE, "source": HOSTILE, "runs": runs,
               "totals": {"runs": 2, "passed": 2 - failed, "failed": failed, "run_seconds": 3.0, "wall_seconds": 2.0}})
    }

    fn page(runs: Vec<Value>, artifacts: &HashMap<String, RunArtifacts>) -> String {
        render_report_html(&report(runs), artifacts).unwrap()
    }

    #[test]
    fn every_string_from_a_run_is_escaped() {
        let name = format!("x/{HOSTILE}");
        let artifacts = HashMap::from([(
            name.clone(),
            RunArtifacts {
                folder: vec![HOSTILE.into()],
                files: vec![(HOSTILE.into(), 3)],
                timeline_svg: Some(format!("<svg><script>alert(3)</script><title>{}</title></svg>", escape(HOSTILE))),
            },
        )]);
        let html = page(vec![run("ok", "pass", None), run(&name, "fail", Some(HOSTILE))], &artifacts);
        // No tag or attribute from a run survives as markup: every tag is one the page writes, every attribute one
        // it sets, every value quoted; the page's own script is the only one.
        for (tag, attrs) in tags(&html) {
            assert!(PAGE_TAGS.contains(&tag.as_str()), "tag <{tag}> in {html}");
            for attr in attrs {
                assert!(PAGE_ATTRIBUTES.contains(&attr.as_str()), "attribute {attr} on <{tag}>");
            }
        }
        assert_eq!(html.matches("<script").count(), 1, "{html}");
        assert!(
            html.contains("&lt;script&gt;alert(1)&lt;/script&gt;&lt;img src=x onerror=alert(2)&gt;&quot;&apos;&amp;")
        );
        for value in html.split(" href=\"").skip(1).map(|v| &v[..v.find('"').unwrap()]) {
            assert!(!value.contains(['<', '>', '\'', ' ']), "{value}");
        }
    }

    const PAGE_TAGS: &[&str] = &[
        "html", "head", "meta", "title", "style", "body", "header", "h1", "h2", "h3", "h4", "p", "span", "strong",
        "code", "pre", "label", "input", "table", "thead", "tbody", "tr", "th", "td", "a", "section", "dl", "dt", "dd",
        "ul", "li", "figure", "svg", "script",
    ];
    const PAGE_ATTRIBUTES: &[&str] =
        &["lang", "charset", "http-equiv", "content", "name", "class", "id", "type", "href", "data-outcome"];

    /// Every tag's name and attribute names; panics on an attribute whose value is not double-quoted.
    fn tags(html: &str) -> Vec<(String, Vec<String>)> {
        let mut out = Vec::new();
        for chunk in html.split('<').skip(1) {
            let tag = &chunk[..chunk.find('>').expect("a closed tag")];
            if tag.starts_with('/') || tag.starts_with('!') {
                continue;
            }
            let (name, mut rest) = tag.split_once(' ').unwrap_or((tag, ""));
            let mut attrs = Vec::new();
            while let Some((attr, after)) = rest.trim_start().split_once("=\"") {
                let end = after.find('"').expect("a quoted value");
                attrs.push(attr.to_string());
                rest = &after[end + 1..];
            }
            assert!(rest.trim().is_empty() || rest.trim() == "/", "stray text in <{tag}>");
            out.push((name.trim_end_matches('/').to_string(), attrs));
        }
        out
    }

    #[test]
    fn the_filter_marks_each_row_with_its_outcome() {
        let html =
            page(vec![run("a/verifier-off", "pass", None), run("b/verifier-on", "fail", Some("why"))], &HashMap::new());
        assert!(html.contains("<input type=\"checkbox\" id=\"only-failed\">"));
        assert_eq!(html.matches("data-outcome=\"pass\"").count(), 1);
        assert_eq!(html.matches("data-outcome=\"fail\"").count(), 1);
        assert!(html.contains("row.dataset.outcome !== 'fail'"));
        // Only the failed run has a details section, linked from its row.
        assert!(html.contains("<a href=\"#run-1\">b/verifier-on</a>"));
        assert!(html.contains("<section class=\"failure\" id=\"run-1\">"));
        assert!(!html.contains("id=\"run-0\""));
        // An outcome the report spells oddly still lands on one of the two words.
        let html = page(vec![run("c", "weird\" onclick=\"x", None)], &HashMap::new());
        assert!(html.contains("data-outcome=\"fail\"") && !html.contains("onclick"));
    }

    #[test]
    fn links_are_relative_and_encoded() {
        let artifacts = HashMap::from([(
            "b/verifier-on".to_string(),
            RunArtifacts {
                folder: ["..", "shard 1", "b", "verifier-on"].map(String::from).to_vec(),
                files: vec![("serial.log".into(), 2048), ("odd #1?.txt".into(), 5), ("javascript:alert(1)".into(), 1)],
                timeline_svg: None,
            },
        )]);
        let html = page(vec![run("b/verifier-on", "fail", Some("why"))], &artifacts);
        assert!(html.contains("<a href=\"../shard%201/b/verifier-on/\">"), "{html}");
        assert!(html.contains(
            "<a href=\"../shard%201/b/verifier-on/serial.log\">serial.log</a> <span class=\"size\">2.0 KiB</span>"
        ));
        assert!(html.contains("href=\"../shard%201/b/verifier-on/odd%20%231%3F.txt\""));
        assert!(html.contains("href=\"../shard%201/b/verifier-on/javascript%3Aalert%281%29\""));
        assert!(html.contains("No timeline.svg"));
        assert_eq!(href(&[], Some("a b")), "a%20b");
    }

    #[test]
    fn a_stop_line_names_its_code_rule_and_parameters() {
        let mut r = run("f/verifier-on", "fail", Some("parameter 2 is 0x2, not 0x1"));
        r["expected"] = json!("bugcheck 0xE6 0x13 0x1 0x0 0x1");
        r["actual"] = json!({"kind": "bugcheck", "code": "0xE6", "params": ["0x13", "0x2", "0x2", "0x1"],
                              "name": "DRIVER_VERIFIER_DMA_VIOLATION", "source": "serial"});
        let html = page(vec![r], &HashMap::new());
        assert!(html.contains("<pre class=\"stop\">*** STOP: 0x000000E6 (0x0000000000000013,0x0000000000000002,"));
        assert!(html.contains("<span class=\"code-name\">DRIVER_VERIFIER_DMA_VIOLATION</span>"));
        assert!(html.contains("rule 0x13: <span class=\"rule\">a DMA routine called at an improper IRQL</span>"));
        assert!(
            html.contains("<tr class=\"differs\"><th>P2</th><td><code>0x2</code></td><td><code>0x1</code></td>"),
            "{html}"
        );
        assert!(html
            .contains("<tr><th>P4</th><td><code>0x1</code></td><td><code>0x1</code></td><td>current IRQL</td></tr>"));
        // Expected a bugcheck, got none: the expectation's parameters are still named.
        let mut r = run("g/verifier-on", "fail", Some("expected bugcheck"));
        r["expected"] = json!("bugcheck 0xE6 0x26 * * 0x5");
        r["actual_text"] = json!("pass");
        let html = page(vec![r], &HashMap::new());
        assert!(html.contains("No STOP line: the run ended in <code>pass</code>."));
        assert!(
            html.contains("<tr><th>P2</th><td><code>—</code></td><td><code>*</code></td><td>device object</td></tr>"),
            "{html}"
        );
    }

    #[test]
    fn not_a_report_is_an_error() {
        assert!(render_report_html(&json!({"runs": []}), &HashMap::new()).is_err());
    }
}

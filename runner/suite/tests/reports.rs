//! Reports read back: JUnit XML parsed with quick-xml, JSON with serde_json, the table as text, the timeline SVG
//! parsed as XML with its marks counted.

use std::collections::HashMap;
use std::path::PathBuf;

use quick_xml::events::Event;
use quick_xml::Reader;
use vhca_suite::{
    completion_seen, judge, parse_event_log, path_marks, render_junit, render_table, render_timeline,
    render_timeline_with, BootPath, Observation, ProcessExit, RunReport, Suite, SuiteReport,
};

/// An element as read back: its name, attributes (unescaped) and text content.
#[derive(Debug, Default, Clone)]
struct Element {
    name: String,
    attrs: HashMap<String, String>,
    text: String,
    depth: usize,
}

/// Parses a whole XML document into a flat list of elements in document order; fails on malformed XML.
fn parse_xml(xml: &str) -> Vec<Element> {
    let mut reader = Reader::from_str(xml);
    let mut out: Vec<Element> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    loop {
        match reader.read_event().unwrap_or_else(|e| panic!("bad XML at {}: {e}\n{xml}", reader.buffer_position())) {
            Event::Start(s) => {
                out.push(element(&s, open.len()));
                open.push(out.len() - 1);
            }
            Event::Empty(s) => out.push(element(&s, open.len())),
            Event::End(_) => {
                open.pop().expect("balanced tags");
            }
            Event::Text(t) => {
                if let Some(&i) = open.last() {
                    out[i].text.push_str(&t.unescape().unwrap());
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    assert!(open.is_empty(), "unclosed elements");
    out
}

fn element(s: &quick_xml::events::BytesStart, depth: usize) -> Element {
    let name = String::from_utf8(s.name().as_ref().to_vec()).unwrap();
    let attrs = s
        .attributes()
        .map(|a| {
            let a = a.unwrap();
            (String::from_utf8(a.key.as_ref().to_vec()).unwrap(), a.unescape_value().unwrap().into_owned())
        })
        .collect();
    Element { name, attrs, text: String::new(), depth }
}

/// The seed suite judged against made-up observations: smoke passes everywhere, fast-mutex-create-cq/verifier-on
/// did not bugcheck (a failure), everything else as expected where cheap to fake.
fn sample_report() -> SuiteReport {
    let mut suite = Suite::seed().unwrap();
    suite.set_driver(vhca_suite::Personality::Native);
    let runs = suite.expand().into_iter().filter(|r| r.run == "smoke" || r.run == "fast-mutex-create-cq");
    let mut reports = Vec::new();
    for (i, run) in runs.enumerate() {
        let mut o = Observation { qemu_exit: ProcessExit::Exited { code: 0 }, ..Default::default() };
        // The failure message carries guest text: markup and a control character must survive into XML.
        o.add_serial("VHCA-RESULT {\"ok\":true,\"note\":\"<&>\"}\n");
        let verdict = judge(&run.expected, &o);
        let mut r = RunReport::new(&run, verdict, 1.25 + i as f64, "tcg", BootPath::Snapshot);
        r.artifact_dir = Some(PathBuf::from(format!("/tmp/vhca/{}", run.name.replace('/', "_"))));
        r.timeline_svg = r.artifact_dir.as_ref().map(|d| d.join("timeline.svg"));
        r.set_reproducer("vhca-run", Some("suites/a b.toml"));
        reports.push(r);
    }
    // One more failure whose reason holds markup and a control character from the guest.
    let run = suite.expand().into_iter().find(|r| r.name == "smoke/verifier-on").unwrap();
    let mut o = Observation { qemu_exit: ProcessExit::Exited { code: 0 }, ..Default::default() };
    o.add_serial("VHCA-RESULT {\"ok\":false,\"error\":\"<cq> & \\u0007bell \\\"q\\\"\"}\n");
    let mut r = RunReport::new(&run, judge(&run.expected, &o), 0.5, "kvm", BootPath::Cold);
    r.name = "smoke/verifier-on-again".into();
    // Notes may carry raw terminal output; XML cannot hold an ESC, so it must arrive replaced, not break the file.
    r.notes.push("guest said \u{1b}[31mred".into());
    r.set_reproducer("vhca-run", None);
    reports.push(r);
    SuiteReport::new(&suite, reports, 3.5)
}

#[test]
fn junit_parses_back_with_every_run_and_failure() {
    let report = sample_report();
    let xml = render_junit(&report);
    assert!(xml.starts_with("<?xml version=\"1.0\" encoding=\"UTF-8\"?>"), "{xml}");
    let elements = parse_xml(&xml);
    let root = &elements[0];
    assert_eq!(root.name, "testsuites");
    assert_eq!(root.attrs["tests"], "5");
    assert_eq!(root.attrs["failures"], "2");
    assert_eq!(root.attrs["time"], "3.500");
    let suite = elements.iter().find(|e| e.name == "testsuite").unwrap();
    assert_eq!(suite.attrs["name"], "seed");
    assert_eq!(suite.depth, 1);
    let cases: Vec<&Element> = elements.iter().filter(|e| e.name == "testcase").collect();
    assert_eq!(
        cases.iter().map(|c| c.attrs["name"].as_str()).collect::<Vec<_>>(),
        [
            "smoke/verifier-off",
            "smoke/verifier-on",
            "fast-mutex-create-cq/verifier-off",
            "fast-mutex-create-cq/verifier-on",
            "smoke/verifier-on-again"
        ]
    );
    assert_eq!(cases[0].attrs["time"], "1.250");
    assert_eq!(cases[3].attrs["classname"], "seed.fast-mutex-create-cq");
    let failures: Vec<&Element> = elements.iter().filter(|e| e.name == "failure").collect();
    assert_eq!(failures.len(), 2);
    assert_eq!(failures[0].attrs["message"], "expected bugcheck 0xE6 0x13 0x1 0x0 0x1, got pass");
    assert!(
        failures[0]
            .text
            .contains("reproduce: vhca-run suite 'suites/a b.toml' --filter '^fast-mutex-create-cq/verifier-on$'"),
        "{}",
        failures[0].text
    );
    // clip() turned the guest's BEL into a space; markup survives escaped and unescaped back.
    assert!(failures[1].attrs["message"].contains("<cq> &  bell \"q\""), "{:?}", failures[1].attrs);
    assert!(failures[1].text.contains("note: guest said \u{FFFD}[31mred"), "{}", failures[1].text);
    assert!(failures[1].text.contains("reproduce: vhca-run suite --filter '^smoke/verifier-on-again$'"));
    let outs: Vec<&Element> = elements.iter().filter(|e| e.name == "system-out").collect();
    assert_eq!(outs.len(), 5);
    assert!(outs[0].text.contains("artifacts: /tmp/vhca/smoke_verifier-off"), "{}", outs[0].text);
    assert!(outs[0].text.contains("timeline: /tmp/vhca/smoke_verifier-off/timeline.svg"));
    assert!(outs[4].text.contains("accelerator: kvm\npath: cold"));
}

#[test]
fn json_report_has_every_field_and_totals() {
    let report = sample_report();
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    assert_eq!(json["suite"], "seed");
    assert_eq!(json["totals"]["runs"], 5);
    assert_eq!(json["totals"]["passed"], 3);
    assert_eq!(json["totals"]["failed"], 2);
    assert_eq!(json["totals"]["wall_seconds"], 3.5);
    let sum: f64 = report.runs.iter().map(|r| r.seconds).sum();
    assert_eq!(json["totals"]["run_seconds"].as_f64().unwrap(), sum);
    let failed = &json["runs"][3];
    assert_eq!(failed["name"], "fast-mutex-create-cq/verifier-on");
    assert_eq!(failed["run"], "fast-mutex-create-cq");
    assert_eq!(failed["mode"], "on");
    assert_eq!(failed["expected"], "bugcheck 0xE6 0x13 0x1 0x0 0x1");
    assert_eq!(failed["actual"]["kind"], "pass");
    assert_eq!(failed["outcome"]["result"], "fail");
    assert_eq!(failed["outcome"]["reason"], "expected bugcheck 0xE6 0x13 0x1 0x0 0x1, got pass");
    assert_eq!(failed["accelerator"], "tcg");
    assert_eq!(failed["path"], "snapshot");
    assert_eq!(failed["artifact_dir"], "/tmp/vhca/fast-mutex-create-cq_verifier-on");
    assert_eq!(failed["timeline_svg"], "/tmp/vhca/fast-mutex-create-cq_verifier-on/timeline.svg");
    assert!(failed["reproducer"].as_str().unwrap().ends_with("--filter '^fast-mutex-create-cq/verifier-on$'"));
    let passed = &json["runs"][0];
    assert_eq!(passed["outcome"]["result"], "pass");
    assert!(passed["reproducer"].is_null());
    assert_eq!(json["runs"][4]["path"], "cold");
}

#[test]
fn table_lists_runs_totals_and_reproducers() {
    let table = render_table(&sample_report());
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("RUN") && lines[0].contains("VERDICT") && lines[0].ends_with("ACCEL"), "{table}");
    assert_eq!(lines.len(), 1 + 5 + 1 + 2, "{table}");
    assert!(lines[1].starts_with("smoke ") && lines[1].contains(" off ") && lines[1].contains("ok   pass"), "{table}");
    assert!(
        lines[4].contains("FAIL expected bugcheck 0xE6 0x13 0x1 0x0 0x1, got pass") && lines[4].contains("4.25"),
        "{table}"
    );
    assert!(lines[4].trim_end().ends_with("tcg"));
    assert_eq!(lines[6], "5 runs: 3 passed, 2 failed; 11.50 s of runs in 3.50 s wall");
    assert!(lines[7].starts_with("reproduce fast-mutex-create-cq/verifier-on: vhca-run suite"));
    // Columns line up: VERDICT starts at the same offset on every row.
    let col = lines[0].find("VERDICT").unwrap();
    assert!(lines[1..6].iter().all(|l| l[col..].starts_with("ok") || l[col..].starts_with("FAIL")), "{table}");
}

const EVENTS: &str = r#"{"seq":0,"t_us":0,"kind":"start","schema":1,"pid":1,"socket":"s","map_registers":16,"version":"0"}
{"seq":1,"t_us":1000,"kind":"map","owner":"cq","handle":1,"registers":4,"first_iova":4096,"in_use":4,"free":12}
{"seq":2,"t_us":1500,"kind":"command","opcode":"CREATE_CQ","tag":1,"status":"OK"}
{"seq":3,"t_us":2000,"kind":"map","owner":"mr","handle":2,"registers":8,"first_iova":65536,"in_use":12,"free":4}
{"seq":4,"t_us":2500,"kind":"command","opcode":"REG_MR","tag":2,"status":"LOC_PROT_ERR"}
{"seq":5,"t_us":3000,"kind":"fault","cause":"iommu_unmapped","dir":"write","purpose":"cqe","iova":4096}
{"seq":6,"t_us":3100,"kind":"dma_fault","iova":4096,"cause":"iommu_unmapped","queue":0}
{"seq":7,"t_us":4000,"kind":"unmap","owner":"mr","handle":2,"registers":8,"in_use":4,"free":12}
"#;

#[test]
fn timeline_svg_parses_and_has_its_marks() {
    let log = parse_event_log(EVENTS);
    let svg = render_timeline("use-after-unmap/verifier-on <&>", &log, Some((3500, "STOP 0xE6")));
    if let Ok(dir) = std::env::var("VHCA_SUITE_SVG_OUT") {
        std::fs::write(format!("{dir}/timeline.svg"), &svg).unwrap();
    }
    let elements = parse_xml(&svg);
    assert_eq!(elements[0].name, "svg");
    let title = elements.iter().find(|e| e.attrs.get("class").map(String::as_str) == Some("title")).unwrap();
    assert!(title.text.starts_with("use-after-unmap/verifier-on <&>"), "{}", title.text);
    let of_class = |c: &str| elements.iter().filter(|e| e.attrs.get("class").map(String::as_str) == Some(c)).count();
    assert_eq!(of_class("in-use"), 1);
    assert_eq!(of_class("fault"), 2);
    assert_eq!(of_class("command"), 2);
    assert_eq!(of_class("bugcheck"), 1);
    assert_eq!(of_class("axis"), 2);
    assert_eq!(of_class("axis-label"), 2);
    // The step line: start, then two points per in_use change, then the end: 1 + 2*3 + 1.
    let line = elements.iter().find(|e| e.attrs.get("class").map(String::as_str) == Some("in-use")).unwrap();
    let points: Vec<(f64, f64)> = line.attrs["points"]
        .split(' ')
        .map(|p| {
            let (x, y) = p.split_once(',').unwrap();
            (x.parse().unwrap(), y.parse().unwrap())
        })
        .collect();
    assert_eq!(points.len(), 8);
    assert!(points.windows(2).all(|w| w[0].0 <= w[1].0), "time only moves forward: {points:?}");
    // 12 of 16 registers is the peak: the highest point (smallest y) is 3/4 of the way up the plot.
    let top = points.iter().map(|p| p.1).fold(f64::MAX, f64::min);
    let bottom = points[0].1;
    assert!(((bottom - top) - 0.75 * 230.0).abs() < 0.2, "peak at {top}, floor at {bottom}");
    // The failed command is orange, the good one grey; markers carry their causes.
    assert!(svg.contains("stroke=\"darkorange\"><title>REG_MR LOC_PROT_ERR</title>"), "{svg}");
    assert!(svg.contains("<title>DMA fault: iommu_unmapped</title>"));
    let label = elements.iter().find(|e| e.attrs.get("class").map(String::as_str) == Some("bugcheck-label")).unwrap();
    assert_eq!(label.text, "STOP 0xE6");
    let ticks: Vec<&str> = elements
        .iter()
        .filter(|e| e.attrs.get("class").map(String::as_str) == Some("tick"))
        .map(|e| e.text.as_str())
        .collect();
    assert!(ticks.contains(&"3.0") && ticks.contains(&"16"), "{ticks:?}");
    assert!(title.text.ends_with("(pool of 16)"), "{}", title.text);
}

#[test]
fn timeline_without_timed_events_says_so() {
    let svg = render_timeline("empty", &parse_event_log("{\"kind\":\"connected\"}\n"), None);
    let elements = parse_xml(&svg);
    assert!(elements.iter().any(|e| e.attrs.get("class").map(String::as_str) == Some("empty")));
    assert!(!elements.iter().any(|e| e.name == "polyline"));
}

#[test]
fn timeline_survives_extreme_timestamps() {
    let log = parse_event_log(&format!(
        "{{\"kind\":\"map\",\"t_us\":0,\"in_use\":1}}\n{{\"kind\":\"fault\",\"t_us\":{},\"cause\":\"outside_mr\"}}\n",
        u64::MAX
    ));
    let svg = render_timeline("extreme", &log, Some((u64::MAX, "STOP 0xE6")));
    let elements = parse_xml(&svg);
    assert_eq!(elements.iter().filter(|e| e.attrs.get("class").map(String::as_str) == Some("fault")).count(), 1);
}

/// A large pool (the device's default 4096) must not flatten a driver's few registers onto the floor: the axis ends
/// a quarter above the peak, and the title still names the pool.
#[test]
fn timeline_of_a_large_pool_scales_to_the_peak() {
    let events = "{\"seq\":0,\"t_us\":0,\"kind\":\"start\",\"schema\":1,\"map_registers\":4096}\n\
        {\"seq\":1,\"t_us\":100,\"kind\":\"map\",\"registers\":8,\"in_use\":8,\"free\":4088,\"total\":4096}\n\
        {\"seq\":2,\"t_us\":200,\"kind\":\"unmap\",\"registers\":8,\"in_use\":0,\"free\":4096,\"total\":4096}\n";
    let svg = render_timeline("big", &parse_event_log(events), None);
    let elements = parse_xml(&svg);
    let line = elements.iter().find(|e| e.attrs.get("class").map(String::as_str) == Some("in-use")).unwrap();
    let ys: Vec<f64> = line.attrs["points"].split(' ').map(|p| p.split_once(',').unwrap().1.parse().unwrap()).collect();
    let (top, bottom) = (ys.iter().copied().fold(f64::MAX, f64::min), ys[0]);
    // Peak 8 on an axis of 10: four fifths of the plot's height, not 8/4096 of it.
    assert!(((bottom - top) - 0.8 * 230.0).abs() < 0.2, "peak at {top}, floor at {bottom}");
    let title = elements.iter().find(|e| e.attrs.get("class").map(String::as_str) == Some("title")).unwrap();
    assert!(title.text.ends_with("(pool of 4096)"), "{}", title.text);
}

/// A vhca.sys run says so in every report: `[sys]` after its name in the table, `"driver": "sys"` in the JSON,
/// `driver: sys` in JUnit's system-out, `--driver sys` in its reproducer; native runs read as before.
#[test]
fn the_driver_personality_shows_in_every_report() {
    let suite = Suite::seed().unwrap();
    let mut reports = Vec::new();
    // The seed suite runs each scenario in both personalities: smoke natively off, as vhca.sys on.
    let picked = ["smoke/verifier-off", "smoke/sys/verifier-on"];
    for run in suite.expand().into_iter().filter(|r| picked.contains(&r.name.as_str())) {
        let o = Observation { qemu_exit: ProcessExit::Exited { code: 0 }, ..Default::default() };
        let mut r = RunReport::new(&run, judge(&run.expected, &o), 1.0, "tcg", BootPath::Snapshot);
        r.set_reproducer("vhca-run", None);
        reports.push(r);
    }
    let report = SuiteReport::new(&suite, reports, 2.0);
    let table = render_table(&report);
    assert!(table.lines().any(|l| l.starts_with("smoke [sys] ") && l.contains(" on ")), "{table}");
    assert!(table.lines().any(|l| l.starts_with("smoke ") && !l.contains("[sys]") && l.contains(" off ")), "{table}");
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    let drivers: Vec<&str> = json["runs"].as_array().unwrap().iter().map(|r| r["driver"].as_str().unwrap()).collect();
    assert_eq!(drivers, ["native", "sys"]);
    let junit = render_junit(&report);
    assert_eq!(junit.matches("driver: sys").count(), 1, "{junit}");
    assert_eq!(junit.matches("driver: native").count(), 1, "{junit}");
    let sys = &report.runs[1];
    assert!(sys.reproducer.as_deref().is_some_and(|r| r.ends_with(" --driver sys")), "{:?}", sys.reproducer);
}

#[test]
fn one_long_verdict_does_not_push_the_other_rows_seconds_off_the_screen() {
    let mut report = sample_report();
    report.runs[0].actual_text = format!("pass, and then {}", "a long explanation from the guest ".repeat(5));
    let table = render_table(&report);
    let lines: Vec<&str> = table.lines().collect();
    let seconds_end = lines[0].find("SECONDS").unwrap() + "SECONDS".len();
    // The verdict column is padded to at most 72 characters, so SECONDS stays near the verdicts of ordinary length.
    assert!(seconds_end < lines[0].find("VERDICT").unwrap() + 72 + 2 + 8, "{table}");
    // Every other row keeps its seconds right under the header's; the long one runs past on its own line.
    for line in &lines[2..6] {
        let secs = line[..seconds_end].trim_end().rsplit(' ').next().unwrap();
        assert!(secs.parse::<f64>().is_ok(), "seconds not under SECONDS in {line:?}:\n{table}");
    }
    assert!(lines[1].contains("a long explanation from the guest") && lines[1].len() > lines[2].len(), "{table}");
}

/// An interrupt run's guest result: the mode, the messages per vector, the driver's ISR and DPC counts and times.
const INTERRUPT_RESULT: &str = r#"VHCA-RESULT {"ok":true,"completion":"interrupt","interrupts":{"per_vector":[5]},"completion_path":{"isr_calls":5,"dpc_calls":4,"dpc_requeues":0,"cqes":6},"completion_times":{"isr_us_before_result":[3000,2500,1200],"dpc_us_before_result":[2900,1100],"isr_untimed":2,"dpc_untimed":0}}
"#;

/// ISR and DPC marks come from a result that has times, keyed in the legend, and are absent from one that has none
/// (a polling run) or when the runner never saw the result line arrive.
#[test]
fn timeline_marks_the_isr_and_dpc_runs_a_result_reports_and_only_those() {
    let log = parse_event_log(EVENTS);
    let mut o = Observation::default();
    o.add_serial(INTERRUPT_RESULT);
    // The result line arrived at 4.5 ms: the first ISR 3 ms before it, at 1.5 ms, on the device's clock.
    let marks = path_marks(&o, Some(4500));
    let svg = render_timeline_with("verbs/verifier-off", &log, None, &marks);
    let elements = parse_xml(&svg);
    let of_class = |c: &str| elements.iter().filter(|e| e.attrs.get("class").map(String::as_str) == Some(c)).count();
    assert_eq!((of_class("isr"), of_class("dpc")), (3, 2), "{svg}");
    let legend: Vec<&str> =
        elements.iter().filter(|e| e.depth == 2 && e.name == "text").map(|e| e.text.as_str()).collect();
    assert!(legend.contains(&"ISR ×3 (+2 untimed)") && legend.contains(&"DPC ×2"), "{legend:?}");
    // The first ISR lands where the grey CREATE_CQ command at 1.5 ms does.
    let x_of = |class: &str| -> Vec<f64> {
        elements
            .iter()
            .filter(|e| e.attrs.get("class").map(String::as_str) == Some(class))
            .map(|e| e.attrs["x1"].parse().unwrap())
            .collect()
    };
    assert_eq!(x_of("isr")[0], x_of("command")[0], "{svg}");

    let mut polled = Observation::default();
    polled.add_serial("VHCA-RESULT {\"ok\":true,\"completion\":\"poll\",\"interrupts\":null}\n");
    for (what, marks) in [("a polling run", path_marks(&polled, Some(4500))), ("no arrival", path_marks(&o, None))] {
        let svg = render_timeline_with("smoke/verifier-off", &log, None, &marks);
        assert!(!svg.contains("class=\"isr\"") && !svg.contains("class=\"dpc\""), "{what}: {svg}");
        assert!(!svg.contains("ISR ×") && !svg.contains("DPC ×"), "{what}: no legend entry without marks");
    }
    assert_eq!(render_timeline_with("t", &log, None, &Default::default()), render_timeline("t", &log, None));
}

/// The interrupt and DPC counts are the run's in the JSON report, one line in JUnit's system-out and the table's
/// summary; a run whose guest said nothing of its completions has no such field (the JSON's shape is otherwise as
/// before).
#[test]
fn interrupt_counts_are_in_each_runs_report() {
    let mut report = sample_report();
    let mut o = Observation::default();
    o.add_serial(INTERRUPT_RESULT);
    report.runs[0].completion = completion_seen(&o);
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    assert_eq!(
        json["runs"][0]["completion"],
        serde_json::json!({"mode": "interrupt", "interrupts": [5], "isr_calls": 5, "dpc_calls": 4, "dpc_requeues": 0, "cqes": 6})
    );
    assert!(json["runs"][1].get("completion").is_none(), "{}", json["runs"][1]);
    let junit = render_junit(&report);
    assert_eq!(
        junit.matches("completion: interrupt: 5 messages, 5 ISR calls, 4 DPC calls (0 re-queued), 6 CQEs").count(),
        1,
        "{junit}"
    );
    let table = render_table(&report);
    assert!(
        table.contains("completion: 1 runs by interrupt (5 messages, 5 ISR calls, 4 DPC calls), 0 polled\n"),
        "{table}"
    );
}

/// The interrupts the device raised (its `notify` lines) are drawn on its own clock, keyed in the legend with
/// their count; a log without them (a polling run) has no such marks.
#[test]
fn timeline_marks_the_interrupts_the_device_raised() {
    let notifies =
        "{\"seq\":8,\"t_us\":1600,\"kind\":\"notify\",\"queue\":0,\"cause\":\"used_buffer\",\"buffers\":1}\n\
        {\"seq\":9,\"t_us\":2600,\"kind\":\"notify\",\"queue\":1,\"cause\":\"cq_event\",\"cq\":1,\"buffers\":1}\n";
    let svg = render_timeline("verbs/verifier-off", &parse_event_log(&format!("{EVENTS}{notifies}")), None);
    let elements = parse_xml(&svg);
    let marks: Vec<&Element> =
        elements.iter().filter(|e| e.attrs.get("class").map(String::as_str) == Some("notify")).collect();
    assert_eq!(marks.len(), 2, "{svg}");
    assert!(svg.contains("stroke=\"olive\"><title>interrupt raised: queue 1, cq_event</title>"), "{svg}");
    let legend: Vec<&str> =
        elements.iter().filter(|e| e.depth == 2 && e.name == "text").map(|e| e.text.as_str()).collect();
    assert!(legend.contains(&"interrupt raised ×2"), "{legend:?}");
    let without = render_timeline("smoke/verifier-off", &parse_event_log(EVENTS), None);
    assert!(!without.contains("class=\"notify\"") && !without.contains("interrupt raised"), "{without}");
}

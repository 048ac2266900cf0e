//! report.html as a person sees it: a suite result judged in-process from made-up observations, its artifact
//! folders written as the runner lays them out, the page rendered by headless Chromium and read back from the DOM
//! after its script ran. The screenshot stays in `<target>/tmp/report-html/report.png` for a person to look at.
//! Needs Debian's `chromium` (ci/setup-host.sh installs it); with CI=true a missing browser fails the test.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use regex::Regex;
use serde_json::json;
use vhca_suite::{
    judge_run, parse_event_log, render_timeline, write_report_html, BootPath, Observation, ProcessExit, RunReport,
    Suite, SuiteReport,
};

/// Guest output that would retitle the page if any of it ran as markup.
const HOSTILE: &str = "<img src=x onerror=\"document.title='PWNED'\"><script>document.title='PWNED'</script>";
/// The same as a file name (which cannot hold a '/').
const HOSTILE_FILE: &str = "<img src=x onerror=\"document.title='PWNED'\">.log";

/// The device's log of a run whose DMA the IOMMU refused before the STOP.
const EVENTS: &str = r#"{"seq":0,"t_us":0,"kind":"start","schema":1,"map_registers":16}
{"seq":1,"t_us":400,"kind":"command","opcode":"QUERY_DEVICE","tag":1,"status":"OK"}
{"seq":2,"t_us":900,"kind":"map","owner":"cq","handle":1,"registers":4,"in_use":4,"free":12}
{"seq":3,"t_us":1500,"kind":"command","opcode":"CREATE_CQ","tag":2,"status":"OK"}
{"seq":4,"t_us":2200,"kind":"map","owner":"mr","handle":2,"registers":8,"in_use":12,"free":4}
{"seq":5,"t_us":2600,"kind":"command","opcode":"REG_MR","tag":3,"status":"MAP_REGISTERS_EXHAUSTED"}
{"seq":6,"t_us":3000,"kind":"fault","cause":"iommu_unmapped","dir":"write","purpose":"cqe","iova":4096}
{"seq":7,"t_us":3300,"kind":"unmap","owner":"mr","handle":2,"registers":8,"in_use":4,"free":12}
"#;

/// What one fabricated run showed: its serial console and device log.
struct Fabricated {
    name: &'static str,
    serial: String,
    events: &'static str,
    /// The STOP on the event log's clock, for the timeline.
    stop_at_us: Option<u64>,
}

fn result_line(ok: bool, error: Option<&str>) -> String {
    let mut result = json!({ "ok": ok });
    if let Some(e) = error {
        result["error"] = json!(e);
    }
    format!("[    2.1] vhca-guest: starting\nVHCA-RESULT {result}\n")
}

fn fabricated() -> Vec<Fabricated> {
    let quiet = "{\"seq\":0,\"t_us\":0,\"kind\":\"start\",\"schema\":1,\"map_registers\":16}\n";
    vec![
        Fabricated { name: "smoke/verifier-off", serial: result_line(true, None), events: quiet, stop_at_us: None },
        Fabricated { name: "smoke/sys/verifier-on", serial: result_line(true, None), events: quiet, stop_at_us: None },
        // Expected 0xE6/0x13 with P2 0x1 (not the IRQL required): the model said 0x2 (above the maximum).
        Fabricated {
            name: "fast-mutex-create-cq/verifier-on",
            serial: "[    2.4] vhca-guest: create_cq\n*** STOP: 0x000000E6 (0x0000000000000013,0x0000000000000002,\
                     0x0000000000000002,0x0000000000000001)\nDRIVER_VERIFIER_DMA_VIOLATION\n"
                .to_string(),
            events: EVENTS,
            stop_at_us: Some(3600),
        },
        // The device never refused the DMA; the guest failed with an error that carries markup.
        Fabricated {
            name: "use-after-unmap/verifier-off",
            serial: result_line(false, Some(HOSTILE)),
            events: quiet,
            stop_at_us: None,
        },
        Fabricated {
            name: "contiguous-cq-fallback/verifier-off",
            serial: result_line(true, None),
            events: quiet,
            stop_at_us: None,
        },
    ]
}

/// The suite result and its artifact root, laid out as `vhca-run suite` leaves them.
fn write_suite_result(root: &Path) -> SuiteReport {
    let suite = Suite::seed().unwrap();
    let runs = suite.expand();
    let mut reports = Vec::new();
    for (i, f) in fabricated().iter().enumerate() {
        let run = runs.iter().find(|r| r.name == f.name).unwrap_or_else(|| panic!("{} not in the seed suite", f.name));
        let log = parse_event_log(f.events);
        let mut o = Observation { qemu_exit: ProcessExit::Exited { code: 0 }, ..Default::default() };
        o.add_serial(&f.serial);
        o.add_event_log(&log);
        let mut r = RunReport::new(run, judge_run(run, &o), 1.5 + i as f64, "tcg", BootPath::Snapshot);
        let dir = root.join(&run.name);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("serial.log"), &f.serial).unwrap();
        fs::write(dir.join("events.jsonl"), f.events).unwrap();
        fs::write(dir.join("observation.json"), serde_json::to_string_pretty(&o).unwrap()).unwrap();
        let mark = f.stop_at_us.map(|t| (t, "STOP 0xE6"));
        fs::write(dir.join("timeline.svg"), render_timeline(&run.name, &log, mark)).unwrap();
        r.artifact_dir = Some(dir.clone());
        r.timeline_svg = Some(dir.join("timeline.svg"));
        r.set_reproducer("vhca-run", None);
        reports.push(r);
    }
    // A file name is guest-chosen text too, as far as the page knows.
    fs::write(root.join("use-after-unmap/verifier-off").join(HOSTILE_FILE), "x").unwrap();
    let report = SuiteReport::new(&suite, reports, 4.0);
    fs::write(root.join("report.json"), report.to_json()).unwrap();
    report
}

fn chromium() -> Option<PathBuf> {
    let found = ["/usr/bin/chromium", "/usr/bin/chromium-browser"].into_iter().map(PathBuf::from).find(|p| p.exists());
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "chromium is not installed (ci/setup-host.sh installs Debian's `chromium`); CI=true: a failure, not a skip"
        );
        eprintln!("SKIP: no chromium; install Debian's `chromium` to render report.html");
    }
    found
}

/// Runs headless Chromium on `url` with `extra` flags; stdout on success. A browser that hangs is killed.
fn run_chromium(browser: &Path, profile: &Path, extra: &[String], url: &str) -> String {
    let _ = fs::remove_dir_all(profile);
    let mut child = Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        .args(["--disable-component-update", "--disable-sync", "--no-first-run"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting chromium");
    let deadline = Instant::now() + Duration::from_secs(90);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium did not finish {url} within 90 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "chromium failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// One verdict-table row as the browser has it after the script ran.
#[derive(Debug)]
struct Row {
    outcome: String,
    hidden: bool,
    name: String,
    personality: String,
    verifier: String,
    badge: String,
    verdict: String,
}

fn rows(dom: &str) -> Vec<Row> {
    let row = Regex::new(
        r#"<tr class="run (pass|fail)" data-outcome="\w+"( hidden="")?><td class="name">(?:<a href="\#run-\d+">)?([^<]*)(?:</a>)?</td><td>([^<]*)</td><td>([^<]*)</td><td class="verdict"><span class="badge \w+">(\w+)</span> ([^<]*)</td><td class="num">[0-9.]+</td></tr>"#,
    )
    .unwrap();
    row.captures_iter(dom)
        .map(|c| Row {
            outcome: c[1].to_string(),
            hidden: c.get(2).is_some(),
            name: c[3].to_string(),
            personality: c[4].to_string(),
            verifier: c[5].to_string(),
            badge: c[6].to_string(),
            verdict: c[7].to_string(),
        })
        .collect()
}

fn section<'a>(dom: &'a str, run_name: &str) -> &'a str {
    let start = dom
        .match_indices("<section class=\"failure\"")
        .map(|(i, _)| i)
        .find(|&i| dom[i..].split("</h3>").next().is_some_and(|h| h.contains(run_name)))
        .unwrap_or_else(|| panic!("no failure section for {run_name}"));
    &dom[start..start + dom[start..].find("</section>").unwrap()]
}

#[test]
fn report_html_reads_right_in_a_browser() {
    let Some(browser) = chromium() else { return };
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report-html");
    let _ = fs::remove_dir_all(&out);
    let root = out.join("artifacts");
    let report = write_suite_result(&root);
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    let page = write_report_html(&root, &json, std::slice::from_ref(&root)).unwrap();
    assert_eq!(page, root.join("report.html"));
    let url = format!("file://{}", fs::canonicalize(&page).unwrap().display());
    let profile = out.join("chromium-profile");

    let screenshot = out.join("report.png");
    let shot = [format!("--screenshot={}", screenshot.display()), "--window-size=1280,2000".to_string()];
    run_chromium(&browser, &profile, &shot, &url);
    let png = fs::read(&screenshot).expect("the screenshot");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000, "{} bytes", png.len());
    eprintln!("screenshot: {}", screenshot.display());

    // The whole table, as the page shows it by default.
    let dom = run_chromium(&browser, &profile, &["--dump-dom".to_string()], &url);
    let table = rows(&dom);
    let names: Vec<&str> = table.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, fabricated().iter().map(|f| f.name).collect::<Vec<_>>(), "{dom}");
    for (row, r) in table.iter().zip(&report.runs) {
        assert_eq!(row.outcome, if r.passed() { "pass" } else { "fail" }, "{row:?}");
        assert_eq!(row.badge, if r.passed() { "pass" } else { "FAIL" });
        assert_eq!((row.personality.as_str(), row.verifier.as_str()), (r.driver.as_str(), r.mode.as_str()));
        assert!(!row.hidden, "{row:?}");
    }
    assert_eq!(table[1].personality, "sys");
    assert!(table[2].verdict.contains("parameter 2 is 0x2, not 0x1"), "{:?}", table[2]);
    assert!(dom.contains("<span id=\"shown\">showing 5 of 5 runs</span>"), "the script did not run: {dom}");

    // The failed-only view: the script hides every passing row.
    let filtered = run_chromium(&browser, &profile, &["--dump-dom".to_string()], &format!("{url}#failed"));
    let visible: Vec<String> = rows(&filtered).into_iter().filter(|r| !r.hidden).map(|r| r.name).collect();
    assert_eq!(visible, ["fast-mutex-create-cq/verifier-on", "use-after-unmap/verifier-off"]);
    assert!(filtered.contains("data-filter=\"failed\"") && filtered.contains("showing 2 of 5 runs"));

    // A failed run's details: the STOP line, its code and rule named, each parameter named, the one that differs
    // marked; the reproducer; the timeline inline with its legend; the artifact links, relative.
    let bugcheck = section(&dom, "fast-mutex-create-cq/verifier-on");
    for expected in [
        "<pre class=\"stop\">*** STOP: 0x000000E6 (0x0000000000000013,0x0000000000000002,0x0000000000000002,0x0000000000000001) DRIVER_VERIFIER_DMA_VIOLATION</pre>",
        "<span class=\"code-name\">DRIVER_VERIFIER_DMA_VIOLATION</span>",
        "rule 0x13: <span class=\"rule\">a DMA routine called at an improper IRQL</span>",
        "<tr><th>P1</th><td><code>0x13</code></td><td><code>0x13</code></td><td>subcode: the rule that was broken</td></tr>",
        "<tr class=\"differs\"><th>P2</th><td><code>0x2</code></td><td><code>0x1</code></td>",
        "<tr><th>P4</th><td><code>0x1</code></td><td><code>0x1</code></td><td>current IRQL</td></tr>",
        "<pre class=\"reproducer\"><code>vhca-run suite --filter '^fast-mutex-create-cq/verifier-on$'</code></pre>",
        "<figure class=\"timeline\"><svg",
        "<text class=\"fault-label\"",
        ">iommu_unmapped</text>",
        "<g class=\"legend\">",
        ">bugcheck (STOP)</text>",
        "<a href=\"fast-mutex-create-cq/verifier-on/serial.log\">serial.log</a>",
        "<a href=\"fast-mutex-create-cq/verifier-on/events.jsonl\">events.jsonl</a>",
        "<a href=\"fast-mutex-create-cq/verifier-on/timeline.svg\">timeline.svg</a>",
    ] {
        assert!(bugcheck.contains(expected), "missing {expected}\nin {bugcheck}");
    }
    // The links lead to the files: resolved against the page, each one exists.
    let href = Regex::new(r##"href="([^"#]+)""##).unwrap();
    let links: Vec<&str> = href.captures_iter(bugcheck).map(|c| c.get(1).unwrap().as_str()).collect();
    assert_eq!(links.len(), 5, "{links:?}");
    for link in links {
        assert!(root.join(link).exists(), "{link} does not exist under {}", root.display());
    }

    // Guest text is text: nothing in it ran (the title would say PWNED), no element came from it.
    let injected = section(&dom, "use-after-unmap/verifier-off");
    assert!(dom.contains("<title>seed: 2 of 5 runs failed — vhca-run</title>"), "{dom}");
    assert!(!dom.contains("<img") && dom.matches("<script").count() == 1, "{dom}");
    assert!(injected.contains("&lt;img src=x onerror=\"document.title='PWNED'\"&gt;&lt;script&gt;"), "{injected}");
    assert!(injected.contains("%3Cimg%20src%3Dx%20onerror%3D%22document.title%3D%27PWNED%27%22%3E"), "{injected}");
}

/// `report merge`'s page: the merged document, each run's folder found under the shard root that holds it and
/// linked from the merge's own folder, so the downloaded roots open side by side.
#[test]
fn a_merged_report_links_each_run_under_its_shard() {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report-html-merge");
    let _ = fs::remove_dir_all(&out);
    let suite = Suite::seed().unwrap();
    let runs = suite.expand();
    let mut shards = Vec::new();
    for (shard, name) in [("shard-1", "smoke/verifier-off"), ("shard-2", "fast-mutex-create-cq/verifier-on")] {
        let run = runs.iter().find(|r| r.name == name).unwrap();
        let mut o = Observation { qemu_exit: ProcessExit::Exited { code: 0 }, ..Default::default() };
        o.add_serial(&result_line(true, None));
        let mut r = RunReport::new(run, judge_run(run, &o), 1.0, "tcg", BootPath::Cold);
        r.set_reproducer("vhca-run", None);
        let root = out.join(shard);
        fs::create_dir_all(root.join(name)).unwrap();
        fs::write(root.join(name).join("serial.log"), "x").unwrap();
        shards.push((root, SuiteReport::new(&suite, vec![r], 1.0).to_json()));
    }
    let docs: Vec<(String, String)> =
        shards.iter().map(|(root, json)| (root.display().to_string(), json.clone())).collect();
    let merged = vhca_suite::merge_json(&docs).unwrap();
    let roots: Vec<PathBuf> = shards.iter().map(|(root, _)| root.clone()).collect();
    let page = write_report_html(&out.join("merged"), &merged.json, &roots).unwrap();
    let html = fs::read_to_string(&page).unwrap();
    assert!(html.contains("<strong>2 runs</strong> from 2 shards"), "{html}");
    let link = "../shard-2/fast-mutex-create-cq/verifier-on/serial.log";
    assert!(html.contains(&format!("<a href=\"{link}\">serial.log</a>")), "{html}");
    assert!(page.parent().unwrap().join(link).exists());
}

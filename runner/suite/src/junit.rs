//! JUnit XML for CI: a testsuite per suite, a testcase per concrete run, a failure element carrying the reason,
//! the notes and the reproducer, and system-out pointing at the run's artifacts. Times are in seconds.

use std::io;

use quick_xml::events::{BytesDecl, BytesText, Event};
use quick_xml::Writer;

use crate::report::{RunReport, SuiteReport};
use crate::xml_text::xml_safe;

/// Renders the report as a JUnit `<testsuites>` document.
pub fn render_junit(report: &SuiteReport) -> String {
    let mut w = Writer::new_with_indent(Vec::new(), b' ', 2);
    // Writing to a Vec cannot fail; an error here would be a quick-xml bug, reported inside the document.
    match write_document(&mut w, report) {
        Ok(()) => String::from_utf8_lossy(&w.into_inner()).into_owned(),
        Err(e) => format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<!-- JUnit rendering failed: {} -->\n<testsuites/>\n",
            xml_safe(&e.to_string()).replace("--", "- -")
        ),
    }
}

fn seconds(s: f64) -> String {
    if s.is_finite() && s >= 0.0 {
        format!("{s:.3}")
    } else {
        "0.000".to_string()
    }
}

fn write_document(w: &mut Writer<Vec<u8>>, report: &SuiteReport) -> io::Result<()> {
    w.write_event(Event::Decl(BytesDecl::new("1.0", Some("UTF-8"), None)))?;
    let t = &report.totals;
    let (tests, failures, time) = (t.runs.to_string(), t.failed.to_string(), seconds(t.wall_seconds));
    w.create_element("testsuites")
        .with_attribute(("name", "vhca-run"))
        .with_attribute(("tests", tests.as_str()))
        .with_attribute(("failures", failures.as_str()))
        .with_attribute(("errors", "0"))
        .with_attribute(("time", time.as_str()))
        .write_inner_content(|w| {
            w.create_element("testsuite")
                .with_attribute(("name", xml_safe(&report.suite).as_ref()))
                .with_attribute(("tests", tests.as_str()))
                .with_attribute(("failures", failures.as_str()))
                .with_attribute(("errors", "0"))
                .with_attribute(("skipped", "0"))
                .with_attribute(("time", time.as_str()))
                .write_inner_content(|w| {
                    w.create_element("properties").write_inner_content(|w| {
                        w.create_element("property")
                            .with_attribute(("name", "source"))
                            .with_attribute(("value", xml_safe(&report.source).as_ref()))
                            .write_empty()?;
                        Ok(())
                    })?;
                    for run in &report.runs {
                        write_testcase(w, &report.suite, run)?;
                    }
                    Ok(())
                })?;
            Ok(())
        })?;
    w.get_mut().push(b'\n');
    Ok(())
}

fn write_testcase(w: &mut Writer<Vec<u8>>, suite: &str, run: &RunReport) -> io::Result<()> {
    let classname = format!("{suite}.{}", run.run);
    w.create_element("testcase")
        .with_attribute(("name", xml_safe(&run.name).as_ref()))
        .with_attribute(("classname", xml_safe(&classname).as_ref()))
        .with_attribute(("time", seconds(run.seconds).as_str()))
        .write_inner_content(|w| {
            if let Some(reason) = run.failure_reason() {
                let mut body = format!("expected: {}\nactual: {}\n", run.expected, run.actual_text);
                for note in &run.notes {
                    body.push_str(&format!("note: {note}\n"));
                }
                if let Some(r) = &run.reproducer {
                    body.push_str(&format!("reproduce: {r}\n"));
                }
                w.create_element("failure")
                    .with_attribute(("message", xml_safe(reason).as_ref()))
                    .with_attribute(("type", "verdict"))
                    .write_text_content(BytesText::new(&xml_safe(&body)))?;
            }
            let mut out =
                format!("accelerator: {}\npath: {}\ndriver: {}\n", run.accelerator, run.path.as_str(), run.driver);
            if let Some(dir) = &run.artifact_dir {
                out.push_str(&format!("artifacts: {}\n", dir.display()));
            }
            if let Some(svg) = &run.timeline_svg {
                out.push_str(&format!("timeline: {}\n", svg.display()));
            }
            if let Some(completion) = &run.completion {
                out.push_str(&format!("completion: {completion}\n"));
            }
            if let Some(i) = &run.interleaving {
                out.push_str(&format!("interleaving: {} (of {})\n", i.spec, i.of));
            }
            for race in &run.races {
                out.push_str(&format!("{race}\n"));
            }
            w.create_element("system-out").write_text_content(BytesText::new(&xml_safe(&out)))?;
            Ok(())
        })?;
    Ok(())
}

//! Writes report.html beside report.json: finds each run's artifact folder under the roots that hold them, reads its
//! file list and timeline, and links them relative to the page, so a downloaded artifact opens where it lands.
//! The one place here that reads files: `vhca-run suite` and `vhca-run report merge` both call it.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use serde_json::Value;

use crate::report_html::{render_report_html, RunArtifacts};

pub const REPORT_HTML: &str = "report.html";
const TIMELINE: &str = "timeline.svg";

/// Renders `report` (report.json's document) into `out_dir/report.html`. A run's folder is `<root>/<run name>`, as
/// the runner stores it, for the first of `run_roots` that has it: the artifact root itself for a suite, each
/// shard's root for a merge.
pub fn write_report_html(out_dir: &Path, report: &Value, run_roots: &[PathBuf]) -> io::Result<PathBuf> {
    // First: the links are worked out from where the page will be, which must exist to be resolved.
    fs::create_dir_all(out_dir)?;
    let mut artifacts = HashMap::new();
    let names = report.get("runs").and_then(Value::as_array).into_iter().flatten();
    for name in names.filter_map(|r| r.get("name")?.as_str()) {
        if let Some(found) = run_roots.iter().find_map(|root| run_artifacts(out_dir, root, name)) {
            artifacts.insert(name.to_string(), found);
        }
    }
    let html = render_report_html(report, &artifacts).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let path = out_dir.join(REPORT_HTML);
    fs::write(&path, html)?;
    Ok(path)
}

fn run_artifacts(out_dir: &Path, root: &Path, run_name: &str) -> Option<RunArtifacts> {
    // A merged report's names come from files that were downloaded: only plain relative names may pick a folder.
    let relative = Path::new(run_name);
    if !relative.components().all(|c| matches!(c, Component::Normal(_))) {
        return None;
    }
    let dir = root.join(relative);
    let mut files = Vec::new();
    for entry in fs::read_dir(&dir).ok()? {
        let entry = entry.ok()?;
        let meta = entry.metadata().ok()?;
        // Subfolders are other runs' (a fail-point run lives inside the run it came from).
        if meta.is_file() {
            files.push((entry.file_name().to_string_lossy().into_owned(), meta.len()));
        }
    }
    files.sort();
    let timeline_svg =
        if files.iter().any(|(f, _)| f == TIMELINE) { fs::read_to_string(dir.join(TIMELINE)).ok() } else { None };
    let folder = relative_path(&fs::canonicalize(out_dir).ok()?, &fs::canonicalize(&dir).ok()?);
    Some(RunArtifacts { folder, files, timeline_svg })
}

/// `to` as seen from `from`, both absolute and canonical: `..` up to the common ancestor, then down.
fn relative_path(from: &Path, to: &Path) -> Vec<String> {
    let (from, to): (Vec<Component>, Vec<Component>) = (from.components().collect(), to.components().collect());
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let up = std::iter::repeat_n("..".to_string(), from.len() - common);
    up.chain(to[common..].iter().map(|c| c.as_os_str().to_string_lossy().into_owned())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_go_up_then_down() {
        let rel = |a: &str, b: &str| relative_path(Path::new(a), Path::new(b)).join("/");
        assert_eq!(rel("/a/root", "/a/root/smoke/verifier-off"), "smoke/verifier-off");
        assert_eq!(rel("/ci/merged", "/ci/shard-2/smoke/verifier-on"), "../shard-2/smoke/verifier-on");
        assert_eq!(rel("/x/y", "/x/y"), "");
    }

    #[test]
    fn only_plain_run_names_pick_a_folder() {
        let dir = std::env::temp_dir();
        assert_eq!(run_artifacts(&dir, &dir, "../etc"), None);
        assert_eq!(run_artifacts(&dir, &dir, "/etc"), None);
    }
}

//! A run's artifact folder, `<root>/<run>/verifier-<mode>/`: its logs and command lines copied from the work dir
//! (sockets left out), the observation as JSON and the timeline picture. The reports link to it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use vhca_suite::{path_marks, render_timeline_with, ConcreteRun};

use crate::evidence::Evidence;

pub const TIMELINE: &str = "timeline.svg";
pub const OBSERVATION: &str = "observation.json";

/// Where the artifact folder and the timeline of a stored run ended up.
#[derive(Debug, Clone)]
pub struct Stored {
    pub dir: PathBuf,
    pub timeline: PathBuf,
}

/// Replaces the run's folder under `root` with this run's files.
pub fn store(root: &Path, run: &ConcreteRun, work: &Path, evidence: &Evidence) -> io::Result<Stored> {
    // Concrete-run names are validated plain names joined by one '/': they stay inside `root`.
    let dir = root.join(&run.name);
    match fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    fs::create_dir_all(&dir)?;
    for entry in fs::read_dir(work)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            fs::copy(entry.path(), dir.join(entry.file_name()))?;
        }
    }
    let observation = serde_json::to_string_pretty(&evidence.observation).map_err(io::Error::other)?;
    fs::write(dir.join(OBSERVATION), observation)?;
    let mark = evidence.crash_mark.as_ref().map(|(t, label)| (*t, label.as_str()));
    let timeline = dir.join(TIMELINE);
    let marks = path_marks(&evidence.observation, evidence.result_seen_us);
    fs::write(&timeline, render_timeline_with(&run.name, &evidence.event_log, mark, &marks))?;
    Ok(Stored { dir, timeline })
}

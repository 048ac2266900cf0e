//! The sharded GitHub workflow (.github/workflows/suite-sharded.yml) as written: linted by actionlint, and played
//! the way GitHub runs it over a fake shard layout, so that its `run:` steps are shown to produce, hand on and merge
//! the artifacts, and to carry the run times from one workflow run to the next.
//!
//! Real here: the workflow text (every `run:` script executed by bash as GitHub's runner does, expressions and
//! conditions evaluated: tests/github_play), the merge (the real `vhca-run report merge`) and the reports (the seed
//! suite's, split by the real shard assignment). Stood in: the actions (modelled by what they do with files),
//! `sudo` and `cargo` (recorded, not run), and the shard's ci/in-debian-container.sh → ci/suite.sh → vhca-run chain,
//! whose last link writes the report prepared for its shard. No Ubuntu runner and no docker ran here.

mod github_play;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

use github_play::{load, scalar, Github, JobRun, Runner, Workflow, WorkflowRun};
use vhca_suite::{render_junit, shard_runs, Actual, BootPath, Outcome, RunReport, Shard, Suite, SuiteReport, Verdict};

const RUNNER: &str = env!("CARGO_BIN_EXE_vhca-run");

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn workflow() -> (PathBuf, Workflow) {
    let path = repo_root().join(".github/workflows/suite-sharded.yml");
    let wf = load(&path);
    (path, wf)
}

/// env.SHARDS and the shard job's matrix values.
fn shards(wf: &Workflow) -> (usize, Vec<String>) {
    let n: usize = scalar(&wf.env["SHARDS"]).parse().expect("env.SHARDS is a number");
    let strategy = wf.jobs["shard"].strategy.as_ref().expect("the shard job has a matrix");
    (n, strategy.matrix["shard"].iter().map(scalar).collect())
}

fn write_script(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

/// `vhca-run suite` for a shard: records its arguments (and the --durations file it was given) and writes the
/// report prepared for its shard into --artifacts, with the prepared exit status.
const FAKE_SHARD_RUNNER: &str = r#"#!/usr/bin/env bash
set -eu
echo "$*" >>"$FAKE_LOG/vhca-run.args"
[ "$1" = suite ] || { echo "fake vhca-run: suite only, not $1" >&2; exit 2; }
shift
shard="" artifacts="" durations=""
while [ $# -gt 0 ]; do
  case "$1" in
    --shard) shard=$2; shift 2 ;;
    --artifacts) artifacts=$2; shift 2 ;;
    --durations) durations=$2; shift 2 ;;
    *) echo "fake vhca-run: unexpected argument $1" >&2; exit 2 ;;
  esac
done
i=${shard%/*}
[ -z "$durations" ] || cp "$durations" "$FAKE_LOG/durations-seen-by-$i.json"
mkdir -p "$artifacts"
if [ -f "$FAKE_REPORTS/$i/report.json" ]; then cp "$FAKE_REPORTS/$i/report.json" "$FAKE_REPORTS/$i/junit.xml" "$artifacts/"; fi
exit "$(cat "$FAKE_REPORTS/$i/exit")"
"#;

/// What one shard's vhca-run does in a scenario.
#[derive(Clone, Copy, PartialEq)]
enum ShardPlay {
    Pass,
    /// One run fails: the report says so and the exit status is 1.
    OneRunFails,
    /// Dies before it writes a report.
    NoReport,
}

/// The seed suite's reports as `vhca-run suite --shard I/N` writes them, one directory per shard.
fn prepare_reports(dir: &Path, n: usize, play: &dyn Fn(usize) -> ShardPlay) {
    let suite = Suite::seed().unwrap();
    let runs = suite.expand();
    for i in 1..=n {
        let shard_dir = dir.join(i.to_string());
        fs::create_dir_all(&shard_dir).unwrap();
        let mine = shard_runs(&runs, Shard::from_str(&format!("{i}/{n}")).unwrap(), &BTreeMap::new());
        assert!(!mine.is_empty(), "shard {i}/{n} of the seed suite is empty");
        let how = play(i);
        let exit = match how {
            ShardPlay::NoReport => 2,
            ShardPlay::Pass => 0,
            ShardPlay::OneRunFails => 1,
        };
        fs::write(shard_dir.join("exit"), exit.to_string()).unwrap();
        if how == ShardPlay::NoReport {
            continue;
        }
        let reports: Vec<RunReport> = mine
            .iter()
            .enumerate()
            .map(|(k, r)| {
                let outcome = if how == ShardPlay::OneRunFails && k == 0 {
                    Outcome::Fail { reason: "expected pass, got hang".into() }
                } else {
                    Outcome::Pass
                };
                let verdict = Verdict { actual: Actual::Pass, outcome, notes: vec![] };
                RunReport::new(r, verdict, 0.5 + k as f64, "kvm", BootPath::Snapshot)
            })
            .collect();
        let report = SuiteReport::new(&suite, reports, 10.0 + i as f64);
        fs::write(shard_dir.join("report.json"), report.to_json()).unwrap();
        fs::write(shard_dir.join("junit.xml"), render_junit(&report)).unwrap();
    }
}

/// One scenario's stand-ins, and what they recorded.
struct Stage {
    dir: tempfile::TempDir,
}

impl Stage {
    fn new(n: usize, play: &dyn Fn(usize) -> ShardPlay) -> Stage {
        let stage = Stage { dir: tempfile::tempdir().unwrap() };
        let (bin, log) = (stage.bin(), stage.log_dir());
        fs::create_dir_all(&log).unwrap();
        // sudo and cargo record what they were asked (stdin too) and do nothing: the play must not change this host.
        for tool in ["sudo", "cargo"] {
            let steps = log.join("steps.log");
            let text = format!("#!/bin/sh\necho \"{tool} $*\" >>'{0}'\n[ -t 0 ] || cat >>'{0}'\n", steps.display());
            write_script(&bin.join(tool), &text);
        }
        write_script(&bin.join("vhca-run-shard"), FAKE_SHARD_RUNNER);
        prepare_reports(&stage.dir.path().join("reports"), n, play);
        stage
    }

    fn bin(&self) -> PathBuf {
        self.dir.path().join("bin")
    }

    fn log_dir(&self) -> PathBuf {
        self.dir.path().join("log")
    }

    /// What checkout leaves: the scripts the steps call, standing in for the repository's, and the merge's
    /// vhca-run (the real binary: `cargo build` is recorded, not run).
    fn checkout(&self, workspace: &Path) {
        let steps = self.log_dir().join("steps.log");
        let container = format!("#!/bin/sh\necho \"in-debian-container.sh $*\" >>'{}'\nexec \"$@\"\n", steps.display());
        write_script(&workspace.join("ci/in-debian-container.sh"), &container);
        // The real ci/suite.sh ends the same way, after set-up and builds that are its own tests' business.
        write_script(&workspace.join("ci/suite.sh"), "#!/bin/sh\nexec \"$VHCA_RUN_BIN\" suite \"$@\"\n");
        fs::create_dir_all(workspace.join("target/release")).unwrap();
        std::os::unix::fs::symlink(RUNNER, workspace.join("target/release/vhca-run")).unwrap();
    }

    fn play(&self, gh: &mut Github, wf: &Workflow) -> WorkflowRun {
        let checkout = |workspace: &Path| self.checkout(workspace);
        let env = vec![
            ("VHCA_RUN_BIN".to_string(), self.bin().join("vhca-run-shard").display().to_string()),
            ("FAKE_LOG".to_string(), self.log_dir().display().to_string()),
            ("FAKE_REPORTS".to_string(), self.dir.path().join("reports").display().to_string()),
        ];
        gh.run(wf, &Runner { path_first: self.bin(), env, checkout: &checkout })
    }

    fn steps_log(&self) -> String {
        fs::read_to_string(self.log_dir().join("steps.log")).unwrap_or_default()
    }

    fn runner_args(&self) -> Vec<String> {
        let text = fs::read_to_string(self.log_dir().join("vhca-run.args")).unwrap_or_default();
        text.lines().map(str::to_string).collect()
    }

    fn durations_seen_by(&self, shard: usize) -> serde_json::Value {
        let text = fs::read_to_string(self.log_dir().join(format!("durations-seen-by-{shard}.json"))).unwrap();
        serde_json::from_str(&text).unwrap()
    }
}

fn merge(run: &WorkflowRun) -> &JobRun {
    run.job("merge")[0]
}

fn merged_report(run: &WorkflowRun) -> serde_json::Value {
    let text = fs::read_to_string(merge(run).workspace.join("merged/report.json")).expect("merged/report.json");
    serde_json::from_str(&text).unwrap()
}

#[test]
fn actionlint_passes_the_workflow() {
    let ci = std::env::var("CI").as_deref() == Ok("true");
    // actionlint checks each run: script with shellcheck only when it finds one: without it half the lint is off.
    for tool in ["actionlint", "shellcheck"] {
        let found = Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().unwrap().status.success();
        if !found {
            assert!(!ci, "{tool} is not installed under CI (ci/setup-host.sh installs it)");
            eprintln!("SKIPPED actionlint_passes_the_workflow: {tool} is not installed (ci/setup-host.sh installs it)");
            return;
        }
    }
    let (path, _) = workflow();
    let out = Command::new("actionlint").arg("-no-color").arg(&path).current_dir(repo_root()).output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "actionlint {}:\n{said}", path.display());
}

#[test]
fn the_matrix_is_every_shard_and_the_runners_get_what_the_steps_need() {
    let (_, wf) = workflow();
    let (n, matrix) = shards(&wf);
    let expected: Vec<String> = (1..=n).map(|i| i.to_string()).collect();
    assert_eq!(matrix, expected, "the shard matrix must be 1..=env.SHARDS");
    for (name, job) in &wf.jobs {
        assert!(job.runs_on.starts_with("ubuntu-"), "{name} runs on GitHub's hosted Ubuntu, not {}", job.runs_on);
    }
    assert_eq!(wf.jobs["merge"].needs(), ["shard"], "the merge waits for the shards");
    // The container builds vhca.sys with the runner's toolchain: the Windows target must be installed there.
    let steps = &wf.jobs["shard"].steps;
    let toolchain = steps.iter().find(|s| s.uses.as_deref().is_some_and(|u| u.starts_with("dtolnay/rust-toolchain")));
    let targets = toolchain.and_then(|s| s.with.get("targets")).map(scalar).unwrap_or_default();
    assert!(targets.split(',').any(|t| t.trim() == "x86_64-pc-windows-msvc"), "shard toolchain targets: {targets:?}");
    // The scripts the play stands in for exist in the repository and can be run.
    for script in ["ci/in-debian-container.sh", "ci/suite.sh"] {
        let meta = fs::metadata(repo_root().join(script)).unwrap_or_else(|e| panic!("{script}: {e}"));
        assert!(meta.permissions().mode() & 0o111 != 0, "{script} is not executable");
    }
}

#[test]
fn passing_shards_merge_into_one_report_whose_times_balance_the_next_run() {
    let (_, wf) = workflow();
    let (n, _) = shards(&wf);
    let runs = Suite::seed().unwrap().expand().len();
    let mut gh = Github::default();
    let stage = Stage::new(n, &|_| ShardPlay::Pass);
    let first = stage.play(&mut gh, &wf);
    for job in first.job("shard") {
        assert!(!job.failed(), "shard {:?}: {:?}", job.matrix, job.failures);
        assert!(first.artifacts.contains_key(&format!("shard-{}", job.matrix["shard"])));
    }
    assert!(!merge(&first).failed(), "merge: {:?}", merge(&first).failures);
    let merged = merged_report(&first);
    assert_eq!((merged["totals"]["runs"].as_u64(), merged["totals"]["failed"].as_u64()), (Some(runs as u64), Some(0)));
    assert_eq!(merged["totals"]["shards"].as_u64(), Some(n as u64));
    assert!(first.artifacts["merged-report"].join("junit.xml").is_file());
    // Each shard ran the README's suite command in the container, without durations the first time.
    let (log, args) = (stage.steps_log(), stage.runner_args());
    for i in 1..=n {
        let command = format!("in-debian-container.sh ci/suite.sh --shard {i}/{n} --artifacts shard-{i}");
        assert!(log.contains(&command), "{log}");
        assert!(args.contains(&format!("suite --shard {i}/{n} --artifacts shard-{i}")), "{args:?}");
    }
    assert!(log.contains("cargo build --release -p vhca-run"), "{log}");
    if Path::new("/dev/kvm").exists() {
        let rule = log.contains(r#"KERNEL=="kvm""#) && log.contains(r#"MODE="0666""#);
        assert!(log.contains("sudo tee /etc/udev/rules.d/") && rule, "{log}");
    }
    assert_eq!(gh.cache.len(), 1, "the merged report is cached");

    // The next run restores it, and every shard is balanced by it.
    let stage = Stage::new(n, &|_| ShardPlay::Pass);
    let second = stage.play(&mut gh, &wf);
    assert!(!merge(&second).failed(), "{:?}", merge(&second).failures);
    let args = stage.runner_args();
    for i in 1..=n {
        let expected = format!("suite --shard {i}/{n} --durations previous-report.json --artifacts shard-{i}");
        assert!(args.contains(&expected), "{args:?}");
        assert_eq!(stage.durations_seen_by(i), merged);
    }
    assert_eq!(gh.cache.len(), 2);
}

#[test]
fn a_failed_run_fails_the_merge_and_its_times_are_still_kept() {
    let (_, wf) = workflow();
    let (n, _) = shards(&wf);
    let mut gh = Github::default();
    let stage = Stage::new(n, &|i| if i == 2 { ShardPlay::OneRunFails } else { ShardPlay::Pass });
    let run = stage.play(&mut gh, &wf);
    // The shard keeps its failure for the merge: its job passes and uploads its report.
    assert!(run.job("shard").iter().all(|j| !j.failed()), "{:?}", run.job("shard")[1].failures);
    assert!(run.artifacts.contains_key("shard-2"));
    let failures = &merge(&run).failures;
    assert_eq!(failures.len(), 1, "only the merge step fails: {failures:?}");
    assert_eq!(failures[0].code, 1, "{failures:?}");
    assert_eq!(merged_report(&run)["totals"]["failed"].as_u64(), Some(1));
    assert!(run.artifacts.contains_key("merged-report"));
    assert_eq!(gh.cache.len(), 1, "the times of a failing run balance the next one as well");
}

#[test]
fn a_shard_without_a_report_fails_its_job_and_the_merge_and_the_cache_keeps_the_last_times() {
    let (_, wf) = workflow();
    let (n, _) = shards(&wf);
    let mut gh = Github::default();
    Stage::new(n, &|_| ShardPlay::Pass).play(&mut gh, &wf);
    assert_eq!(gh.cache.len(), 1);
    let stage = Stage::new(n, &|i| if i == 3 { ShardPlay::NoReport } else { ShardPlay::Pass });
    let run = stage.play(&mut gh, &wf);
    for job in run.job("shard") {
        assert_eq!(job.failed(), job.matrix["shard"] == "3", "shard {:?}: {:?}", job.matrix, job.failures);
    }
    assert!(!run.artifacts.contains_key("shard-3"));
    let failures = &merge(&run).failures;
    assert_eq!(failures.first().map(|f| f.code), Some(2), "a missing shard is report merge's exit 2: {failures:?}");
    assert!(!merge(&run).workspace.join("merged/report.json").exists());
    assert_eq!(gh.cache.len(), 1, "no merged report, so nothing new is cached");
}

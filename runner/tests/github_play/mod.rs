//! GitHub Actions, as far as .github/workflows/suite-sharded.yml uses it: the workflow's shape, its `${{ }}`
//! expressions and `if:` conditions, jobs and steps run in GitHub's order, and the actions modelled by what they do
//! with files (checkout by a stand-in the caller gives, cache and artifacts by stores kept here).
//!
//! Whatever the play does not know (an action, an expression, a condition, a shell) fails the test that meets it,
//! so the workflow cannot grow something the play would silently get wrong.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_norway::Value;

/// The parts of a workflow the play reads; the rest is actionlint's to check.
#[derive(Debug, Deserialize)]
pub struct Workflow {
    #[serde(default)]
    pub env: BTreeMap<String, Value>,
    pub jobs: BTreeMap<String, Job>,
}

#[derive(Debug, Deserialize)]
pub struct Job {
    #[serde(rename = "runs-on")]
    pub runs_on: String,
    #[serde(default)]
    pub needs: Option<Value>,
    #[serde(rename = "if", default)]
    pub condition: Option<String>,
    #[serde(default)]
    pub strategy: Option<Strategy>,
    #[serde(default)]
    pub env: BTreeMap<String, Value>,
    pub steps: Vec<Step>,
}

#[derive(Debug, Deserialize)]
pub struct Strategy {
    pub matrix: BTreeMap<String, Vec<Value>>,
}

#[derive(Debug, Deserialize)]
pub struct Step {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub uses: Option<String>,
    #[serde(default)]
    pub run: Option<String>,
    #[serde(default)]
    pub shell: Option<String>,
    #[serde(rename = "if", default)]
    pub condition: Option<String>,
    #[serde(default)]
    pub with: BTreeMap<String, Value>,
    #[serde(default)]
    pub env: BTreeMap<String, Value>,
}

impl Job {
    pub fn needs(&self) -> Vec<String> {
        match &self.needs {
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Sequence(v)) => v.iter().map(scalar).collect(),
            _ => vec![],
        }
    }

    /// One map per job instance: the matrix's single dimension (all this workflow uses), or one empty map.
    fn instances(&self) -> Vec<BTreeMap<String, String>> {
        let Some(strategy) = &self.strategy else { return vec![BTreeMap::new()] };
        assert_eq!(strategy.matrix.len(), 1, "the play knows one-dimensional matrices only");
        let (key, values) = strategy.matrix.iter().next().unwrap();
        values.iter().map(|v| BTreeMap::from([(key.clone(), scalar(v))])).collect()
    }
}

pub fn load(path: &Path) -> Workflow {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("expected a scalar, found {other:?}"),
    }
}

/// The contexts an expression may read.
struct Context {
    env: BTreeMap<String, String>,
    matrix: BTreeMap<String, String>,
    github: BTreeMap<&'static str, String>,
}

impl Context {
    fn value(&self, expr: &str) -> String {
        let found = expr.split_once('.').and_then(|(ctx, key)| match ctx {
            "env" => self.env.get(key).cloned(),
            "matrix" => self.matrix.get(key).cloned(),
            "github" => self.github.get(key).cloned(),
            _ => None,
        });
        found.unwrap_or_else(|| panic!("the play does not know the expression {expr:?}"))
    }

    fn expand(&self, text: &str) -> String {
        let mut out = String::new();
        let mut rest = text;
        while let Some(start) = rest.find("${{") {
            out.push_str(&rest[..start]);
            let end = rest[start..].find("}}").expect("an unclosed ${{") + start;
            out.push_str(&self.value(rest[start + 3..end].trim()));
            rest = &rest[end + 2..];
        }
        out.push_str(rest);
        out
    }

    fn expand_all(&self, pairs: &BTreeMap<String, Value>) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.clone(), self.expand(&scalar(v)))).collect()
    }
}

/// An `if:` as GitHub reads it: without a status function, `success() &&` is implied.
fn condition_holds(condition: Option<&str>, failed_before: bool, workspace: &Path) -> bool {
    let Some(condition) = condition else { return !failed_before };
    let mut status_given = false;
    let mut holds = true;
    for term in condition.split("&&").map(str::trim) {
        let status = match term {
            "always()" => Some(true),
            "success()" => Some(!failed_before),
            "failure()" => Some(failed_before),
            _ => None,
        };
        holds &= match status {
            Some(s) => {
                status_given = true;
                s
            }
            None => {
                let path = term
                    .strip_prefix("hashFiles('")
                    .and_then(|t| t.strip_suffix("') != ''"))
                    .unwrap_or_else(|| panic!("the play does not know the condition {term:?}"));
                workspace.join(path).exists()
            }
        };
    }
    holds && (status_given || !failed_before)
}

/// What every runner of the play gets: a PATH directory put first, environment, and what checkout leaves.
pub struct Runner<'a> {
    pub path_first: PathBuf,
    pub env: Vec<(String, String)>,
    pub checkout: &'a dyn Fn(&Path),
}

/// A `run:` step that failed: its name, exit code and output (the name and output are for assertion messages).
#[derive(Debug)]
#[allow(dead_code)]
pub struct Failure {
    pub step: String,
    pub code: i32,
    pub output: String,
}

pub struct JobRun {
    pub job: String,
    pub matrix: BTreeMap<String, String>,
    pub workspace: PathBuf,
    pub ran: bool,
    pub failures: Vec<Failure>,
}

impl JobRun {
    pub fn failed(&self) -> bool {
        !self.ran || !self.failures.is_empty()
    }
}

pub struct WorkflowRun {
    pub jobs: Vec<JobRun>,
    pub artifacts: BTreeMap<String, PathBuf>,
    _scratch: tempfile::TempDir,
}

impl WorkflowRun {
    pub fn job(&self, name: &str) -> Vec<&JobRun> {
        self.jobs.iter().filter(|j| j.job == name).collect()
    }
}

/// GitHub across workflow runs: the cache outlives a run, the artifacts do not.
#[derive(Default)]
pub struct Github {
    /// Cache entries in the order they were saved: (key, the file's bytes).
    pub cache: Vec<(String, Vec<u8>)>,
    run_id: u32,
}

impl Github {
    /// One workflow run: the jobs without `needs` first (every matrix instance), then the ones that need them.
    pub fn run(&mut self, wf: &Workflow, runner: &Runner) -> WorkflowRun {
        self.run_id += 1;
        let scratch = tempfile::tempdir().unwrap();
        let (mut jobs, mut artifacts): (Vec<JobRun>, _) = (vec![], BTreeMap::new());
        let (first, then): (Vec<_>, Vec<_>) = wf.jobs.iter().partition(|(_, job)| job.needs().is_empty());
        for (name, job) in first.into_iter().chain(then) {
            let needed_failed = job.needs().iter().any(|n| {
                assert!(wf.jobs[n].needs().is_empty(), "the play knows one level of needs");
                jobs.iter().any(|j| j.job == *n && j.failed())
            });
            for matrix in job.instances() {
                let workspace = scratch.path().join(format!("job-{}", jobs.len() + 1));
                fs::create_dir_all(&workspace).unwrap();
                let mut job_run = JobRun { job: name.clone(), matrix, workspace, ran: false, failures: vec![] };
                if condition_holds(job.condition.as_deref(), needed_failed, Path::new("/nonexistent")) {
                    job_run.ran = true;
                    self.run_job(wf, job, &mut job_run, runner, &mut artifacts, scratch.path());
                }
                jobs.push(job_run);
            }
        }
        WorkflowRun { jobs, artifacts, _scratch: scratch }
    }

    fn run_job(
        &mut self,
        wf: &Workflow,
        job: &Job,
        out: &mut JobRun,
        runner: &Runner,
        artifacts: &mut BTreeMap<String, PathBuf>,
        scratch: &Path,
    ) {
        let mut ctx = Context {
            env: BTreeMap::new(),
            matrix: out.matrix.clone(),
            github: BTreeMap::from([
                ("ref_name", "main".to_string()),
                ("run_id", self.run_id.to_string()),
                ("run_attempt", "1".to_string()),
            ]),
        };
        let mut env = ctx.expand_all(&wf.env);
        ctx.env.extend(env.iter().cloned());
        env.extend(ctx.expand_all(&job.env));
        ctx.env.extend(env.iter().cloned());
        for step in &job.steps {
            if !condition_holds(step.condition.as_deref(), !out.failures.is_empty(), &out.workspace) {
                continue;
            }
            let with = |key: &str| step.with.get(key).map(|v| ctx.expand(&scalar(v)));
            match (&step.uses, &step.run) {
                (Some(uses), None) => {
                    let action = uses.split('@').next().unwrap();
                    self.action(action, &with, &out.workspace, runner, artifacts, scratch);
                }
                (None, Some(script)) => {
                    let mut step_env = env.clone();
                    step_env.extend(ctx.expand_all(&step.env));
                    if let Some(code_output) = run_script(&ctx.expand(script), step, &step_env, &out.workspace, runner)
                    {
                        let step = ctx.expand(step.name.as_deref().unwrap_or("run"));
                        out.failures.push(Failure { step, code: code_output.0, output: code_output.1 });
                    }
                }
                _ => panic!("a step with both or neither of uses and run: {:?}", step.name),
            }
        }
    }

    fn action(
        &mut self,
        action: &str,
        with: &dyn Fn(&str) -> Option<String>,
        workspace: &Path,
        runner: &Runner,
        artifacts: &mut BTreeMap<String, PathBuf>,
        scratch: &Path,
    ) {
        let need = |key: &str| with(key).unwrap_or_else(|| panic!("{action} without {key}"));
        match action {
            "actions/checkout" => (runner.checkout)(workspace),
            // The runner's toolchain is the host's here.
            "dtolnay/rust-toolchain" => {}
            "actions/cache/restore" => {
                let (path, key) = (workspace.join(need("path")), need("key"));
                let prefixes: Vec<String> = with("restore-keys")
                    .map(|k| k.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect())
                    .unwrap_or_default();
                // The exact key first, then each prefix in turn, the newest entry for each.
                let newest = |pred: &dyn Fn(&str) -> bool| self.cache.iter().rev().find(|(k, _)| pred(k));
                let hit = newest(&|k| k == key)
                    .or_else(|| prefixes.iter().find_map(|p| newest(&|k| k.starts_with(p.as_str()))));
                if let Some((_, bytes)) = hit {
                    fs::write(path, bytes).unwrap();
                }
            }
            "actions/cache/save" => {
                let key = need("key");
                let bytes = fs::read(workspace.join(need("path"))).expect("cache/save of a missing file");
                assert!(!self.cache.iter().any(|(k, _)| *k == key), "cache key {key} saved twice");
                self.cache.push((key, bytes));
            }
            "actions/upload-artifact" => {
                let (name, path) = (need("name"), workspace.join(need("path")));
                // GitHub warns and uploads nothing when the path holds no file.
                if !is_empty_dir(&path) {
                    let stored = scratch.join("artifacts").join(&name);
                    assert!(!stored.exists(), "artifact {name} uploaded twice");
                    copy_dir(&path, &stored);
                    artifacts.insert(name, stored);
                }
            }
            "actions/download-artifact" => {
                let pattern = need("pattern");
                let prefix = pattern.strip_suffix('*').expect("a pattern of the form prefix*");
                // Downloaded by pattern, each artifact lands in a directory of its own name.
                for (name, stored) in artifacts.iter().filter(|(n, _)| n.starts_with(prefix)) {
                    copy_dir(stored, &workspace.join(name));
                }
            }
            other => panic!("the play does not know the action {other}"),
        }
    }
}

/// Runs a `run:` script as GitHub's runner does; Some((exit code, output)) when it failed.
fn run_script(
    script: &str,
    step: &Step,
    env: &[(String, String)],
    workspace: &Path,
    runner: &Runner,
) -> Option<(i32, String)> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("step.sh");
    fs::write(&path, script).unwrap();
    let mut cmd = Command::new("bash");
    match step.shell.as_deref() {
        // GitHub's default on Linux, and what `shell: bash` means.
        None => cmd.arg("-e"),
        Some("bash") => cmd.args(["--noprofile", "--norc", "-eo", "pipefail"]),
        Some(other) => panic!("the play does not know the shell {other}"),
    };
    let search = format!("{}:{}", runner.path_first.display(), std::env::var("PATH").unwrap());
    let out = cmd
        .arg(&path)
        .current_dir(workspace)
        .envs(env.iter().cloned())
        .envs(runner.env.iter().cloned())
        .env("PATH", search)
        .env("CI", "true")
        .env("GITHUB_WORKSPACE", workspace)
        .env("TMPDIR", dir.path())
        .output()
        .unwrap();
    (!out.status.success()).then(|| {
        let text = String::from_utf8_lossy(&[out.stdout, out.stderr].concat()).into_owned();
        (out.status.code().unwrap_or(-1), text)
    })
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn is_empty_dir(dir: &Path) -> bool {
    fs::read_dir(dir).map(|mut d| d.next().is_none()).unwrap_or(true)
}

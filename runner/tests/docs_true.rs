//! The docs stay true: every path, flag, crate, count and named thread README.md and docs/*.md state is checked
//! against the tree and the built binaries (docs_check), and a broken copy shows the check fails on each kind.

mod docs_check;

use std::path::{Path, PathBuf};

use docs_check::{BinaryHelp, Problem};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The three binaries whose flags the docs show, from the release dir this test's own vhca-run was built into.
/// vhca-device and vhca-load are other packages' binaries: the workspace test builds them before any test runs,
/// `cargo test -p vhca-run` alone does not.
fn binaries() -> BinaryHelp {
    let run = PathBuf::from(env!("CARGO_BIN_EXE_vhca-run"));
    let dir = run.parent().expect("vhca-run has a folder").to_path_buf();
    let build = "cargo build --release -p vhca-run -p vhca-device -p vhca-loader";
    BinaryHelp::new(&[
        ("vhca-run", run, build),
        ("vhca-device", dir.join("vhca-device"), build),
        ("vhca-load", dir.join("vhca-load"), build),
    ])
}

/// Under CI every binary must be there; elsewhere a missing one skips only its flags, loudly.
fn require_binaries(help: &BinaryHelp) {
    let missing = help.missing();
    if missing.is_empty() {
        return;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("the docs check needs every binary under CI: {}", missing.join("; "));
    }
    for why in missing {
        eprintln!("SKIPPED its flags: {why}");
    }
}

#[test]
fn the_docs_are_true() {
    let help = binaries();
    require_binaries(&help);
    let report = docs_check::check(&repo(), &help).unwrap_or_else(|e| panic!("{e}"));
    // A binary that is built but whose --help fails is a broken command, not a skip.
    let missing = help.missing();
    let failed: Vec<&String> = report.unchecked.iter().filter(|why| !missing.contains(why)).collect();
    assert!(failed.is_empty(), "flags the check could not read: {failed:?}");
    let listed: Vec<String> = report.problems.iter().map(Problem::to_string).collect();
    assert!(listed.is_empty(), "{} claim(s) of the docs the tree contradicts:\n{}", listed.len(), listed.join("\n"));
}

/// Copies the tree but its build outputs and git's store; a file another engineer moves away meanwhile is skipped.
fn copy_tree(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let name = entry.file_name();
        if name == "target" || name == ".git" {
            continue;
        }
        let Ok(kind) = entry.file_type() else { continue };
        let dest = to.join(&name);
        if kind.is_dir() {
            std::fs::create_dir_all(&dest).unwrap();
            copy_tree(&entry.path(), &dest);
        } else if kind.is_file() {
            match std::fs::copy(entry.path(), &dest) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => panic!("copying {}: {e}", entry.path().display()),
            }
        }
    }
}

/// Replaces `needle` on the first line of `doc` that holds it; returns that line (1-based).
fn break_line(root: &Path, doc: &str, needle: &str, replacement: &str) -> usize {
    let path = root.join(doc);
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let at = lines
        .iter()
        .position(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("{doc} no longer holds {needle:?}: give the test another claim to break"));
    lines[at] = lines[at].replacen(needle, replacement, 1);
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    at + 1
}

/// The 1-based line of `heading` in `doc`.
fn heading_line(root: &Path, doc: &str, heading: &str) -> usize {
    let text = std::fs::read_to_string(root.join(doc)).unwrap();
    1 + text.lines().position(|l| l == heading).unwrap_or_else(|| panic!("{doc} has no {heading:?}"))
}

fn append(path: &Path, text: &str) {
    let mut old = std::fs::read_to_string(path).unwrap_or_default();
    old.push_str(text);
    std::fs::write(path, old).unwrap();
}

#[test]
fn a_broken_copy_fails_on_each_kind_of_claim() {
    let help = binaries();
    let copy = tempfile::tempdir().unwrap();
    let root = copy.path();
    copy_tree(&repo(), root);
    let check = |what: &str| docs_check::check(root, &help).unwrap_or_else(|e| panic!("{what}: {e}")).problems;
    // Whatever the tree itself is wrong about (another engineer's move under way) is not what this test breaks.
    let before = check("the copy as it was");

    // One claim of each kind, broken as it breaks in real life: a doc names a file or a flag that is not there, a
    // count or a key list the code does not have, or leaves a page out of the index; a crate or a thread arrives in
    // the code and the docs go on as before.
    let path_line = break_line(root, "README.md", "docs/fuzz.md", "docs/fuzzing.md");
    let flag_line = break_line(root, "README.md", "vhca-run suite --cold", "vhca-run suite --frozen");
    let count_line = break_line(
        root,
        "docs/suites.md",
        " concrete runs (`vhca-run suite --list`)",
        "0 concrete runs (`vhca-run suite --list`)",
    );
    let keys_line = break_line(root, "docs/suites.md", ", `each_fail_point`", "");
    let index_line = heading_line(root, "README.md", "| doc | what |");
    break_line(root, "README.md", "| [docs/loader.md](docs/loader.md) |", "| loader |");
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    std::fs::write(root.join("Cargo.toml"), manifest.replacen("members = [", "members = [\"guest-driver/shim\", ", 1))
        .unwrap();
    std::fs::create_dir_all(root.join("guest-driver/shim")).unwrap();
    std::fs::write(root.join("guest-driver/shim/Cargo.toml"), "[package]\nname = \"vhca-shim\"\n\n[dependencies]\n")
        .unwrap();
    append(
        &root.join("runner/src/log_shipper.rs"),
        "//! Ships logs.\npub fn start() {\n    std::thread::Builder::new().name(\"log-shipper\".into()).spawn(|| ()).unwrap();\n}\n",
    );
    let crates_line = heading_line(root, "docs/architecture.md", "## Crates");
    let threads_line = heading_line(root, "docs/architecture.md", "## Processes and threads of one run");

    let after = check("the broken copy");
    let new: Vec<&Problem> = after.iter().filter(|p| !before.contains(p)).collect();
    let expected = [
        ("README.md", path_line, "`docs/fuzzing.md`"),
        ("README.md", flag_line, "`vhca-run suite --frozen`"),
        ("docs/suites.md", count_line, "0 concrete runs\""),
        ("docs/suites.md", keys_line, "`run[2].expct`: expected one of"),
        ("README.md", index_line, "`docs/loader.md`"),
        ("docs/architecture.md", crates_line, "crate `vhca-shim` (guest-driver/shim)"),
        ("docs/architecture.md", threads_line, "thread \"log-shipper\" (runner/src/log_shipper.rs:3)"),
    ];
    let shown = new.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("\n");
    for (doc, line, claim) in expected {
        assert!(
            new.iter().any(|p| p.doc == doc && p.line == line && p.claim.contains(claim)),
            "no problem reported for {doc}:{line} {claim}; the new ones:\n{shown}"
        );
    }
    assert_eq!(new.len(), expected.len(), "only the broken claims are new:\n{shown}");
}

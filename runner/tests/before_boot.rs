//! What the runner settles before it starts a guest, from its command line: a suite naming a scenario the guest
//! program does not know is refused (nothing boots), and every command that starts a guest, `windows-image build`
//! included, reports the accelerator of the one probe (accel.rs). The accelerator test needs the guest image:
//! prerequisites missing, it fails under CI=true and is skipped with the reason elsewhere.

mod common;

use std::process::Command;

use common::*;

#[test]
fn a_misspelt_scenario_is_refused_with_the_closest_name_before_anything_boots() {
    let s = Scratch::new();
    let file = s.tmp.path().join("typo.toml");
    let text =
        "name = \"typo\"\n\n[[run]]\nname = \"loop\"\nexpect = \"pass\"\nguest = { scenario = \"verbs-loopbak\" }\n";
    std::fs::write(&file, text).unwrap();
    let out = s.command(&["suite", file.to_str().unwrap()]).output().expect("run vhca-run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    let expected =
        format!("unknown scenario \"verbs-loopbak\" in {}:4; did you mean \"verbs-loopback\"?", file.display());
    assert!(stderr.contains(&expected), "{}", show(&out));
    // Refused before the session: no image, no accelerator, no work dir.
    assert!(!stderr.contains("accelerator"), "the runner got as far as choosing an accelerator:\n{stderr}");
    let left: Vec<_> = std::fs::read_dir(s.tmp.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("typo.toml")], "something was made besides the suite file");
}

/// `accelerator NAME (HOW)` from a line that ends with it, with HOW's cache prefix dropped (the first command to ask
/// may probe, the next reads that probe's record).
fn accelerator(line: &str) -> (String, String) {
    let rest = &line[line.find("accelerator ").expect("an accelerator line") + "accelerator ".len()..];
    let (name, how) = rest.split_once(" (").expect("accelerator NAME (HOW)");
    // HOW may hold parentheses of its own (a QEMU exit status): the line ends with the one that closes it.
    let how = how.trim_end().strip_suffix(')').expect("accelerator NAME (HOW)");
    let how = how.strip_prefix("cached probe for this boot: ").or_else(|| how.strip_prefix("probe: ")).unwrap_or(how);
    (name.to_string(), how.to_string())
}

#[test]
fn windows_image_build_reports_the_accelerator_of_the_same_probe_as_a_run() {
    if !ready("windows_image_build_reports_the_accelerator_of_the_same_probe_as_a_run") {
        return;
    }
    let s = Scratch::new();
    let run = Command::new(RUNNER)
        .env("TMPDIR", s.tmp.path())
        .env_remove("VHCA_ACCEL")
        .args(["qemu-args", "--scenario", "smoke", "--dir"])
        .arg(s.tmp.path().join("lines"))
        .output()
        .expect("run vhca-run");
    assert!(run.status.success(), "qemu-args:\n{}", show(&run));
    let stdout = String::from_utf8_lossy(&run.stdout);
    let of_run =
        accelerator(stdout.lines().find(|l| l.contains("accelerator")).expect("qemu-args names its accelerator"));

    // A driver package and an ISO that does not exist: the build stops at its input check, after the accelerator.
    let package = s.tmp.path().join("vhca-sys");
    std::fs::create_dir(&package).unwrap();
    std::fs::write(package.join("vhca.sys"), b"MZ").unwrap();
    let build = Command::new(RUNNER)
        .env("TMPDIR", s.tmp.path())
        .env_remove("VHCA_ACCEL")
        .args(["windows-image", "build", "--iso"])
        .arg(s.tmp.path().join("no-such.iso"))
        .arg("--out")
        .arg(s.tmp.path().join("image"))
        .arg("--driver-package")
        .arg(&package)
        .output()
        .expect("run vhca-run");
    let stderr = String::from_utf8_lossy(&build.stderr);
    let line = stderr.lines().find(|l| l.starts_with("vhca-run windows-image: accelerator"));
    let of_build = accelerator(line.unwrap_or_else(|| panic!("windows-image names no accelerator:\n{}", show(&build))));
    assert_eq!(of_build, of_run, "windows-image and a run disagree on the accelerator:\n{}", show(&build));
    assert!(!stderr.contains("/dev/kvm opens"), "windows-image judged KVM by /dev/kvm alone:\n{stderr}");
    eprintln!("both: accelerator {} ({})", of_run.0, of_run.1);
}

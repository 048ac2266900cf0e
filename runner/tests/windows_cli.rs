//! vhca-run's Windows commands end to end without Windows: a Windows suite without an image fails with a clear
//! message (CI=true or not: never a skip that passes), `debug --print-only` prints the KDNET/WinDbg and EXDI lines of a
//! (fake) image, and `windows-image answer-file` writes the generated files. No QEMU, no Windows.

use std::path::Path;
use std::process::{Command, Output};

const RUNNER: &str = env!("CARGO_BIN_EXE_vhca-run");

fn show(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn windows_suite(dir: &Path, image_line: &str) -> std::path::PathBuf {
    let path = dir.join("win.toml");
    let text =
        format!("name = \"win\"\nguest = \"windows\"\n{image_line}\n[[run]]\nname = \"smoke\"\nexpect = \"pass\"\n");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_windows_suite_without_an_image_fails_clearly_with_and_without_ci() {
    let dir = tempfile::tempdir().unwrap();
    let suite = windows_suite(dir.path(), "");
    for ci in ["true", ""] {
        let out = Command::new(RUNNER).arg("suite").arg(&suite).env("CI", ci).output().unwrap();
        let text = show(&out);
        assert_eq!(out.status.code(), Some(2), "{text}");
        assert!(text.contains("runs Windows guests (guest = \"windows\") but names no image"), "{text}");
        assert!(text.contains("--windows-image") && text.contains("vhca-run windows-image build"), "{text}");
        assert!(!text.contains("SKIPPED") && !text.to_lowercase().contains("skip"), "{text}");
    }
    // A named image that is not there is just as clear, from the suite or the flag.
    let suite = windows_suite(dir.path(), "windows_image = \"no-such-image\"");
    let out = Command::new(RUNNER).arg("suite").arg(&suite).env("CI", "true").output().unwrap();
    let text = show(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains(&format!("no Windows image at {}", dir.path().join("no-such-image").display())), "{text}");
    let out =
        Command::new(RUNNER).args(["--windows-image", "/nonexistent/w"]).arg("suite").arg(&suite).output().unwrap();
    assert!(show(&out).contains("no Windows image at /nonexistent/w"), "{}", show(&out));
}

#[test]
fn debug_print_only_gives_the_windbg_and_exdi_lines_of_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("img");
    std::fs::create_dir(&image).unwrap();
    let meta = serde_json::json!({
        "firmware": "uefi", "edition": "Windows 11 Pro", "kdnet_host_ip": "10.0.2.2", "kdnet_port": 50005,
        "kdnet_key": "aa.bb.cc.dd", "verifier_states": [0, 170], "driver_package": "target/vhca-sys"
    });
    std::fs::write(image.join("image.json"), meta.to_string()).unwrap();
    std::fs::write(image.join("base.qcow2"), b"").unwrap();
    let suite = windows_suite(dir.path(), "windows_image = \"img\"");
    let out = Command::new(RUNNER)
        .args(["debug", "--run", "smoke/verifier-on", "--print-only", "--gdb-port", "4444", "--suite"])
        .arg(&suite)
        .output()
        .unwrap();
    let text = show(&out);
    assert!(out.status.success(), "{text}");
    for want in [
        "windbg -k net:port=50005,key=aa.bb.cc.dd",
        "port 50005, key aa.bb.cc.dd",
        "UDP4-LISTEN:50005",
        ":4444",
        "EXDI",
    ] {
        assert!(text.contains(want), "missing {want:?}:\n{text}");
    }
    // The Linux-only commands refuse a Windows suite's run instead of booting Linux for it.
    for (cmd, says) in
        [("boot", "boot runs the Linux guest"), ("qemu-args", "qemu-args prints the Linux guest's lines")]
    {
        let out =
            Command::new(RUNNER).args([cmd, "--run", "smoke/verifier-on", "--suite"]).arg(&suite).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", show(&out));
        assert!(show(&out).contains(says), "{}", show(&out));
    }
    // A Linux suite refuses a Windows image rather than silently ignoring it.
    let out = Command::new(RUNNER)
        .args(["--windows-image"])
        .arg(&image)
        .args(["debug", "--run", "smoke/verifier-on", "--print-only"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(show(&out).contains("runs the Linux guest"), "{}", show(&out));
}

#[test]
fn answer_file_writes_the_generated_disc_files() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(RUNNER)
        .args([
            "windows-image",
            "answer-file",
            "--edition",
            "Windows Server 2022 SERVERDATACENTER",
            "--firmware",
            "bios",
            "--out",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let xml = std::fs::read_to_string(dir.path().join("autounattend.xml")).unwrap();
    assert!(xml.contains("<Value>Windows Server 2022 SERVERDATACENTER</Value>"), "{xml}");
    assert!(xml.contains("<Active>true</Active>"), "BIOS: an active MBR partition");
    let setup = std::fs::read_to_string(dir.path().join("vhca/vhca-setup.ps1")).unwrap();
    assert!(setup.contains("bcdedit /dbgsettings net hostip:10.0.2.2 port:50000 key:"), "{setup}");
    assert!(dir.path().join("vhca/vhca-agent.ps1").is_file());
}

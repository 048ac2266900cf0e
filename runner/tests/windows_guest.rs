//! Golden tests of what the Windows image recipe generates: autounattend.xml (well-formed; the passes, components,
//! partitions and first-logon commands), the in-guest set-up sequence and script, the agent's protocol words and
//! command sequence (and that the registry names it writes are the ones vhca.sys reads), and the answer disc the real xorriso builds from them. Windows itself never read any of it here: these machines
//! have no Windows ISO.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;

use quick_xml::events::Event;
use quick_xml::Reader;
use vhca_run::qemu_cmd::Accel;
use vhca_run::restore::request_line;
use vhca_run::snapshot::READY_LINE;
use vhca_run::windows_guest::agent_script::{
    agent_script, HARDWARE_IDS, PARAMETERS_KEY, REQUEST_VALUES, RESULT_VALUE, RESULT_WAIT_S, SCENARIO_VALUE,
};
use vhca_run::windows_guest::answer_file::{AnswerSettings, FirstLogonCommand};
use vhca_run::windows_guest::guest_setup::{first_logon_commands, setup_script, setup_steps, SETUP_DONE, SETUP_FAILED};
use vhca_run::windows_guest::kdnet::{KdnetKey, KdnetSettings, SLIRP_HOST};
use vhca_run::windows_guest::machine::Firmware;
use vhca_run::windows_guest::recipe::{
    answer_disc_files, qemu_img_overlay, state_request, write_answer_disc, xorriso_args, BuildOptions,
};

/// An element: depth, name, attributes, text.
type Element = (usize, String, Vec<(String, String)>, String);

/// Elements in document order; panics on malformed XML.
fn parse(xml: &str) -> Vec<Element> {
    let mut r = Reader::from_str(xml);
    let mut out = Vec::new();
    let mut stack: Vec<usize> = Vec::new();
    loop {
        match r.read_event().expect("well-formed XML") {
            Event::Start(e) => {
                let attrs = e
                    .attributes()
                    .map(|a| {
                        let a = a.unwrap();
                        (String::from_utf8(a.key.as_ref().to_vec()).unwrap(), a.unescape_value().unwrap().into_owned())
                    })
                    .collect();
                out.push((stack.len(), String::from_utf8(e.name().as_ref().to_vec()).unwrap(), attrs, String::new()));
                stack.push(out.len() - 1);
            }
            Event::Text(t) => {
                if let Some(&i) = stack.last() {
                    out[i].3.push_str(&t.unescape().unwrap());
                }
            }
            Event::End(_) => {
                stack.pop();
            }
            Event::Eof => break,
            _ => {}
        }
    }
    assert!(stack.is_empty(), "unclosed elements");
    out
}

fn settings(firmware: Firmware) -> AnswerSettings {
    AnswerSettings {
        edition: "Windows 11 Pro".into(),
        locale: "en-US".into(),
        product_key: None,
        computer_name: "VHCA-WIN".into(),
        account: "vhca".into(),
        password: "p<&>\"'w".into(),
        firmware,
        first_logon: first_logon_commands(),
    }
}

fn texts<'a>(doc: &'a [Element], name: &str) -> Vec<&'a str> {
    doc.iter().filter(|e| e.1 == name).map(|e| e.3.as_str()).collect()
}

#[test]
fn autounattend_has_the_passes_and_components_setup_reads() {
    let xml = settings(Firmware::Uefi).to_xml();
    assert!(xml.starts_with("<?xml version=\"1.0\" encoding=\"utf-8\"?>"));
    let doc = parse(&xml);
    assert_eq!(doc[0].1, "unattend");
    assert!(doc[0].2.contains(&("xmlns".into(), "urn:schemas-microsoft-com:unattend".into())));
    assert!(doc[0].2.contains(&("xmlns:wcm".into(), "http://schemas.microsoft.com/WMIConfig/2002/State".into())));
    let passes: Vec<&str> = doc
        .iter()
        .filter(|e| e.1 == "settings")
        .map(|e| e.2.iter().find(|a| a.0 == "pass").unwrap().1.as_str())
        .collect();
    assert_eq!(passes, ["windowsPE", "specialize", "oobeSystem"]);
    let components: Vec<String> = doc
        .iter()
        .filter(|e| e.1 == "component")
        .map(|e| {
            let attr = |k: &str| e.2.iter().find(|a| a.0 == k).unwrap().1.clone();
            assert_eq!(
                (attr("processorArchitecture"), attr("publicKeyToken"), attr("language"), attr("versionScope")),
                ("amd64".into(), "31bf3856ad364e35".into(), "neutral".into(), "nonSxS".into())
            );
            attr("name")
        })
        .collect();
    assert_eq!(
        components,
        [
            "Microsoft-Windows-International-Core-WinPE",
            "Microsoft-Windows-Setup",
            "Microsoft-Windows-Shell-Setup",
            "Microsoft-Windows-International-Core",
            "Microsoft-Windows-Shell-Setup",
        ]
    );
    // Edition, install target, EULA, the Windows 11 checks skipped, the account and its one automatic logon.
    assert_eq!(texts(&doc, "Value")[0], "Windows 11 Pro");
    assert_eq!(texts(&doc, "Key"), ["/IMAGE/NAME"]);
    assert_eq!(texts(&doc, "AcceptEula"), ["true"]);
    let lab: Vec<&str> = texts(&doc, "Path");
    assert_eq!(lab.len(), 3);
    assert!(lab.iter().all(|p| p.starts_with(r"reg add HKLM\SYSTEM\Setup\LabConfig /v Bypass")));
    assert_eq!(texts(&doc, "Name"), ["vhca"]);
    assert_eq!(texts(&doc, "Username"), ["vhca"]);
    assert_eq!(texts(&doc, "LogonCount"), ["1"]);
    assert_eq!(texts(&doc, "HideOnlineAccountScreens"), ["true"]);
    // The password survives escaping, in the account and in the automatic logon.
    let pw: Vec<&str> = doc.iter().filter(|e| e.1 == "Value" && e.3.starts_with('p')).map(|e| e.3.as_str()).collect();
    assert_eq!(pw, ["p<&>\"'w", "p<&>\"'w"]);
    // No product key element unless one is given.
    assert!(texts(&doc, "ProductKey").is_empty());
    let mut with_key = settings(Firmware::Uefi);
    with_key.product_key = Some("AAAAA-BBBBB-CCCCC-DDDDD-EEEEE".into());
    assert_eq!(texts(&parse(&with_key.to_xml()), "WillShowUI"), ["OnError"]);
}

#[test]
fn disk_layout_follows_the_firmware() {
    let uefi = parse(&settings(Firmware::Uefi).to_xml());
    assert_eq!(texts(&uefi, "Type"), ["EFI", "MSR", "Primary"]);
    assert_eq!(texts(&uefi, "Size"), ["100", "16"]);
    assert_eq!(texts(&uefi, "Format"), ["FAT32", "NTFS"]);
    assert_eq!(texts(&uefi, "PartitionID"), ["1", "2", "3", "3"], "three partitions, Windows on the third");
    assert_eq!(texts(&uefi, "WillWipeDisk"), ["true"]);
    let bios = parse(&settings(Firmware::Bios).to_xml());
    assert_eq!(texts(&bios, "Type"), ["Primary"]);
    assert_eq!(texts(&bios, "Active"), ["true"]);
    assert_eq!(texts(&bios, "PartitionID"), ["1", "1"]);
}

#[test]
fn first_logon_copies_the_rig_folder_then_runs_the_set_up() {
    let doc = parse(&settings(Firmware::Uefi).to_xml());
    let orders: Vec<&str> = doc
        .iter()
        .enumerate()
        .filter(|(_, e)| e.1 == "Order")
        .filter(|(i, _)| doc[..*i].iter().rev().find(|p| p.0 < doc[*i].0).is_some_and(|p| p.1 == "SynchronousCommand"))
        .map(|(_, e)| e.3.as_str())
        .collect();
    assert_eq!(orders, ["1", "2"]);
    assert_eq!(
        texts(&doc, "CommandLine"),
        [
            r"cmd /c for %d in (D E F G H I J) do if exist %d:\vhca\vhca-setup.ps1 xcopy /e /i /y %d:\vhca C:\vhca",
            r"powershell -NoProfile -ExecutionPolicy Bypass -File C:\vhca\vhca-setup.ps1",
        ]
    );
    let _: Vec<FirstLogonCommand> = first_logon_commands();
}

fn kdnet() -> KdnetSettings {
    KdnetSettings::new(SLIRP_HOST, 50000, KdnetKey::parse("k1.k2.k3.k4").unwrap()).unwrap()
}

#[test]
fn in_guest_set_up_sequence() {
    let commands: Vec<String> = setup_steps(&kdnet()).into_iter().map(|s| s.command).collect();
    assert_eq!(
        commands,
        [
            "bcdedit /set testsigning on",
            r"certutil -addstore -f Root C:\vhca\driver\vhca-test.cer",
            r"certutil -addstore -f TrustedPublisher C:\vhca\driver\vhca-test.cer",
            r#"powershell -NoProfile -Command "New-FileCatalog -Path C:\vhca\driver -CatalogFilePath C:\vhca\driver\vhca.cat -CatalogVersion 2.0""#,
            r#"powershell -NoProfile -Command "$c = Import-PfxCertificate -FilePath C:\vhca\driver\vhca-test.pfx -CertStoreLocation Cert:\LocalMachine\My -Password (ConvertTo-SecureString vhca -AsPlainText -Force); if ((Set-AuthenticodeSignature -FilePath C:\vhca\driver\vhca.cat -Certificate $c -HashAlgorithm SHA256).Status -ne 'Valid') { exit 1 }""#,
            r"pnputil /add-driver C:\vhca\driver\vhca.inf /install",
            "bcdedit /dbgsettings net hostip:10.0.2.2 port:50000 key:k1.k2.k3.k4",
            "bcdedit /debug {default} on",
            r"reg add HKLM\SYSTEM\CurrentControlSet\Control\CrashControl /v CrashDumpEnabled /t REG_DWORD /d 3 /f",
            r"reg add HKLM\SYSTEM\CurrentControlSet\Control\CrashControl /v AutoReboot /t REG_DWORD /d 1 /f",
            "sc config wuauserv start= disabled",
            "powercfg /hibernate off",
            r#"schtasks /create /f /tn vhca-agent /sc onstart /ru SYSTEM /rl HIGHEST /tr "powershell -NoProfile -ExecutionPolicy Bypass -File C:\vhca\vhca-agent.ps1""#,
        ]
    );
    let script = setup_script(&setup_steps(&kdnet()));
    // Every step is in the script once, numbered, with PowerShell's quote doubling; the script ends powered off.
    assert!(script.contains("  ,@(1, 'test signing on', 'bcdedit /set testsigning on', @(0))\n"), "{script}");
    assert!(script.contains(r"'pnputil /add-driver C:\vhca\driver\vhca.inf /install', @(0, 259, 3010))"), "{script}");
    assert!(script.contains("  ,@(13, 'resident agent at every boot', 'schtasks /create"), "{script}");
    assert!(script.contains("if ($s[3] -notcontains $rc)"), "{script}");
    assert!(script.contains(&format!("Say '{SETUP_DONE}'")));
    assert!(script.contains(&format!("{SETUP_FAILED} step $($s[0]) ($($s[1])): exit $rc")));
    assert!(script.trim_end().ends_with("shutdown /s /t 0"));
    let step =
        vhca_run::windows_guest::guest_setup::SetupStep { what: "it's", command: "echo 'x'".into(), also_ok: &[] };
    let quoted = setup_script(&[step]);
    assert!(quoted.contains(",@(1, 'it''s', 'echo ''x''', @(0))"), "{quoted}");
}

#[test]
fn the_agent_speaks_the_runners_protocol() {
    // The runner waits for READY_LINE, types restore::request_line's JSON and reads VHCA-RESULT lines.
    let agent = agent_script();
    assert!(agent.contains(&format!("Say '{READY_LINE}'")));
    assert!(agent.contains("ConvertFrom-Json") && agent.contains("$request.params"));
    assert!(agent.contains("\"VHCA-RESULT \""));
    assert!(agent.contains(SETUP_DONE) && agent.contains(SETUP_FAILED));
    let request: serde_json::Value =
        serde_json::from_str(&request_line(&[("vhca.scenario".into(), "smoke".into())])).unwrap();
    assert!(request["params"].is_array(), "the agent reads .params");
    let state: serde_json::Value = serde_json::from_str(&state_request(0xAA)).unwrap();
    assert_eq!(state["params"], serde_json::json!(["vhca.setup=verifier", "vhca.verifier=0xaa"]));
    assert!(agent.contains("$params['vhca.setup'] -eq 'verifier'"));
    assert!(!agent.contains("vhca-scenario"), "no scenario tool: vhca.sys runs the scenario itself");
}

/// What a run request does, in order: find the one HCA, discard the boot's own result, write the scenario and its
/// options (deleting those the request does not carry), restart the device so START_DEVICE reads them, poll for the
/// result (bounded), print it unchanged.
#[test]
fn the_agents_run_sequence() {
    let agent = agent_script();
    let lines: Vec<&str> = agent.lines().map(str::trim).collect();
    assert!(lines.contains(&r"$key = 'HKLM:\SYSTEM\CurrentControlSet\Services\vhca\Parameters'"), "{agent}");
    assert!(lines.contains(&r"$ids = @('PCI\VEN_1AF4&DEV_1059', 'PCI\VEN_1AF4&DEV_106A')"), "{agent}");
    let acts = [
        "Get-PnpDevice",
        "Get-ItemProperty",
        "Remove-ItemProperty",
        "New-ItemProperty",
        "$pair",
        "pnputil",
        "Say $result",
    ];
    let sequence: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| !l.starts_with('#') && !l.starts_with("Say \"") && acts.iter().any(|a| l.contains(a)))
        .filter(|l| !l.starts_with("if ("))
        .collect();
    assert_eq!(
        sequence,
        [
            "$hca = @(Get-PnpDevice -PresentOnly | Where-Object { @($_.HardwareID | Where-Object { $ids -contains $_ }).Count -gt 0 })",
            "$boot = (Get-ItemProperty -Path $key -Name Result -ErrorAction SilentlyContinue).Result",
            "Remove-ItemProperty -Path $key -Name Result -ErrorAction SilentlyContinue",
            "foreach ($pair in @(@('vhca.scenario', 'Scenario'), @('vhca.lock', 'Lock'), @('vhca.break_fix', 'BreakFix'))) {",
            "$word, $name = $pair",
            "New-ItemProperty -Path $key -Name $name -PropertyType String -Value $params[$word] -Force -ErrorAction Stop | Out-Null",
            "Remove-ItemProperty -Path $key -Name $name -ErrorAction SilentlyContinue",
            "$out = & pnputil /restart-device $instance 2>&1",
            "$result = (Get-ItemProperty -Path $key -Name Result -ErrorAction SilentlyContinue).Result",
            // vhca.power's sleep step, after the result is read and before it is printed: the HCA looked at after
            // each resume (agent_script.rs's own tests hold the step's order).
            "$hca = Get-PnpDevice -InstanceId $instance -ErrorAction SilentlyContinue",
            // vhca.pnp's step after it: the HCA's state looked up, and pnputil's verbs (agent_script.rs's tests hold
            // the sequences).
            "function Hca-State { Get-PnpDevice -InstanceId $instance -ErrorAction SilentlyContinue }",
            "$out = & pnputil $verb $instance 2>&1",
            "& pnputil /scan-devices 2>&1 | ForEach-Object { Say \"  $_\" }",
            "Say $result",
        ],
        "{agent}"
    );
    assert!(agent.contains(&format!("$deadline = (Get-Date).AddSeconds({RESULT_WAIT_S})")));
    assert!(agent.contains("if ($result -notlike 'VHCA-RESULT *')"));
    // Every way out of a run request ends in a VHCA-RESULT line or a power-off after one: each `Fail` is followed by `Off`.
    for line in lines.iter().filter(|l| l.contains("Fail $scenario") || l.contains("Fail ''")) {
        assert!(line.contains("; Off"), "a failure that does not end the run: {line}");
    }
    assert!(agent.trim_end().ends_with("Say $result\nOff"), "{agent}");
}

/// The text of a file of the driver crate (guest-driver/sys), by path from the workspace root.
fn driver_file(path: &str) -> String {
    let full = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// The Rust string literal that follows `prefix` in `text`, up to its closing quote, with `\\` undone (the literals
/// read here hold no escaped quote).
fn literal_after(text: &str, prefix: &str) -> String {
    let at = text.find(prefix).unwrap_or_else(|| panic!("{prefix:?} not found"));
    let rest = &text[at + prefix.len()..];
    let end = rest.find('"').unwrap_or_else(|| panic!("no closing quote after {prefix:?}"));
    rest[..end].replace("\\\\", "\\")
}

/// The agent's registry path, value names and hardware ids are the ones vhca.sys and vhca.inf use. The two crates
/// cannot share constants (the driver's registry code is kernel-only and the runner does not link the driver), so
/// this test reads the driver's sources: a rename on either side fails it.
#[test]
fn the_agent_writes_what_the_driver_reads() {
    let registry = driver_file("guest-driver/sys/src/kernel/registry.rs");
    let key = literal_after(&registry, "const KEY_TEXT: &str = \"");
    let ours = format!(r"\Registry\Machine\{PARAMETERS_KEY}");
    // The driver opens the key with OBJ_CASE_INSENSITIVE; registry names ignore case.
    assert!(key.eq_ignore_ascii_case(&ours), "driver opens {key}, agent writes {ours}");
    let driver_values = [
        literal_after(&registry, "SCENARIO: [u16; 8] = utf16(\""),
        literal_after(&registry, "LOCK: [u16; 4] = utf16(\""),
        literal_after(&registry, "BREAK_FIX: [u16; 8] = utf16(\""),
    ];
    let ours: Vec<&str> = REQUEST_VALUES.iter().map(|(_, value)| *value).collect();
    assert_eq!(driver_values, ours.as_slice());
    assert_eq!(REQUEST_VALUES.map(|(word, _)| word), ["vhca.scenario", "vhca.lock", "vhca.break_fix"]);
    assert_eq!(REQUEST_VALUES[0].1, SCENARIO_VALUE);
    assert_eq!(literal_after(&registry, "static RESULT: [u16; 6] = utf16(\""), RESULT_VALUE);
    let pnp = driver_file("guest-driver/sys/src/kernel/pnp.rs");
    for read in ["read_text(&registry::SCENARIO)", "read_text(&registry::LOCK)", "read_text(&registry::BREAK_FIX)"] {
        assert!(pnp.contains(read), "START_DEVICE no longer does {read}");
    }
    assert!(pnp.contains("registry::write_result(&line)"));
    let result_line = driver_file("guest-driver/sys/src/result_line.rs");
    assert_eq!(literal_after(&result_line, "pub const RESULT_PREFIX: &str = \""), "VHCA-RESULT ");

    let inf = driver_file("guest-driver/sys/vhca.inf");
    for id in HARDWARE_IDS {
        assert!(inf.lines().any(|l| l.trim_end().ends_with(&format!("vhca_Install, {id}"))), "{id} not in vhca.inf");
    }
    // HKR in the service's AddReg is Services\vhca: the INF's default Scenario lands in the key the agent writes.
    assert!(inf.contains("AddService = vhca,") && inf.contains("HKR,Parameters,Scenario,0x00000000,"), "{inf}");
    assert!(PARAMETERS_KEY.ends_with(r"Services\vhca\Parameters"));
    let agent = agent_script();
    assert!(agent.contains(&format!("-Name {RESULT_VALUE} -ErrorAction SilentlyContinue).{RESULT_VALUE}")));
}

/// The recipe's inputs as a user would give them, with `package` as the driver package.
fn options(package: PathBuf) -> BuildOptions {
    BuildOptions {
        iso: "/isos/win11.iso".into(),
        driver_package: package,
        out: "/images/win11".into(),
        edition: "Windows 11 Pro".into(),
        locale: "en-US".into(),
        product_key: None,
        account: "vhca".into(),
        password: "vhca".into(),
        firmware: Firmware::Uefi,
        kdnet_host_ip: Ipv4Addr::new(10, 0, 2, 2),
        kdnet_port: 50000,
        verifier_flags: vec![0xAA],
        qemu: "qemu-system-x86_64".into(),
        accel: Accel::Kvm,
        vnc: None,
    }
}

#[test]
fn answer_disc_and_tool_command_lines() {
    let opts = options("target/vhca-sys".into());
    let files = answer_disc_files(&opts, &kdnet());
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["autounattend.xml", "vhca/vhca-setup.ps1", "vhca/vhca-agent.ps1"]);
    parse(&files[0].1);
    assert!(files[1].1.contains("key:k1.k2.k3.k4"));
    assert_eq!(
        xorriso_args(&PathBuf::from("/w/answer"), &PathBuf::from("/images/win11/answer.iso")),
        [
            "-as",
            "mkisofs",
            "-quiet",
            "-J",
            "-joliet-long",
            "-r",
            "-V",
            "VHCA_ANSWER",
            "-o",
            "/images/win11/answer.iso",
            "/w/answer"
        ]
    );
    assert_eq!(
        qemu_img_overlay("base.qcow2", &PathBuf::from("/images/win11/state-verifier-off.qcow2")),
        ["create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "/images/win11/state-verifier-off.qcow2"]
    );
}

#[test]
fn xorriso_here_builds_the_answer_disc() {
    if Command::new("xorriso").arg("-version").output().is_err() {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("xorriso missing under CI (ci/setup-host.sh installs it)");
        }
        eprintln!("SKIPPED xorriso_here_builds_the_answer_disc: no xorriso");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let package = dir.path().join("vhca-sys");
    std::fs::create_dir(&package).unwrap();
    for f in ["vhca.inf", "vhca.sys", "vhca-test.cer", "vhca-test.pfx", "vhca-verbs-test.exe"] {
        std::fs::write(package.join(f), f).unwrap();
    }
    let opts = options(package);
    let kd = KdnetSettings::new(SLIRP_HOST, 50000, KdnetKey::generate().unwrap()).unwrap();
    let iso = dir.path().join("answer.iso");
    write_answer_disc(&opts, &kd, &dir.path().join("staging"), &iso).unwrap();
    let out = Command::new("xorriso").args(["-indev"]).arg(&iso).args(["-find", "/", "-type", "f"]).output().unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    for f in [
        "/autounattend.xml",
        "/vhca/vhca-setup.ps1",
        "/vhca/vhca-agent.ps1",
        "/vhca/driver/vhca.sys",
        "/vhca/driver/vhca.inf",
        "/vhca/driver/vhca-test.cer",
        "/vhca/driver/vhca-test.pfx",
        "/vhca/driver/vhca-verbs-test.exe",
    ] {
        assert!(listing.contains(f), "{f} not on the disc:\n{listing}");
    }
    let out = Command::new("xorriso").args(["-indev"]).arg(&iso).args(["-pvd_info"]).output().unwrap();
    let info = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(info.contains("VHCA_ANSWER"), "{info}");
}

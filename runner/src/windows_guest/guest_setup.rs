//! What runs inside the Windows guest, as generated text: the set-up steps of a new image (test signing, the test
//! certificate, the driver package, KDNET, crash dumps, the resident agent) as a PowerShell script that reports each
//! step on COM1, the `FirstLogonCommands` that start it, and the boot-state commands (Driver Verifier on with the
//! suite's flags, or off). Commands after Microsoft's references for bcdedit, certutil, pnputil, verifier, schtasks and
//! the CrashControl registry values. None of it has run on Windows here: these machines have no Windows image.

use super::answer_file::FirstLogonCommand;
use super::kdnet::KdnetSettings;

/// Where the image keeps the rig's files (copied from the answer disc at the first logon).
pub const GUEST_DIR: &str = r"C:\vhca";
/// The driver package's folder inside it.
pub const GUEST_DRIVER_DIR: &str = r"C:\vhca\driver";
/// The folder on the answer disc that is copied to `GUEST_DIR`.
pub const DISC_DIR: &str = "vhca";
/// Set-up progress lines on COM1: `VHCA-SETUP step N: WHAT`, then `VHCA-SETUP-DONE` or
/// `VHCA-SETUP-FAILED step N (WHAT): …`.
pub const SETUP_MARK: &str = "VHCA-SETUP";
pub const SETUP_DONE: &str = "VHCA-SETUP-DONE";
pub const SETUP_FAILED: &str = "VHCA-SETUP-FAILED";
/// The resident agent (agent_script.rs), copied into the image.
pub const AGENT_FILE: &str = "vhca-agent.ps1";
pub const SETUP_FILE: &str = "vhca-setup.ps1";
/// The scheduled task that starts the agent at every boot, before anyone logs on.
pub const AGENT_TASK: &str = "vhca-agent";
/// The files the driver package must hold (`ci/build-windows.sh` writes them to target/vhca-sys/): the INF,
/// the test-signed driver, the test certificate it was signed with, that certificate with its key (password
/// `vhca`) to sign the catalog the guest makes, and the user-mode test program the agent runs for `vhca.user`.
pub const PACKAGE_FILES: [&str; 5] = ["vhca.inf", "vhca.sys", "vhca-test.cer", "vhca-test.pfx", "vhca-verbs-test.exe"];
/// The catalog vhca.inf names (`CatalogFile = vhca.cat`): no Linux tool makes one, so the guest does (docs/windows.md).
pub const CATALOG_FILE: &str = "vhca.cat";

/// One set-up step: what it does, in words for the log, the command, and which non-zero exits mean it worked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetupStep {
    pub what: &'static str,
    pub command: String,
    pub also_ok: &'static [i32],
}

fn step(what: &'static str, command: impl Into<String>) -> SetupStep {
    SetupStep { what, command: command.into(), also_ok: &[] }
}

/// pnputil's "installed, reboot needed" (3010, ERROR_SUCCESS_REBOOT_REQUIRED) and "no device to install on"
/// (259, ERROR_NO_MORE_ITEMS): the package is in the store either way, and no HCA exists during set-up. An assumption
/// from Microsoft's PnPUtil return-value page, never seen here.
const PNPUTIL_ALSO_OK: &[i32] = &[259, 3010];

/// The steps of a new image, in order. The driver is staged and installed before any HCA exists (pnputil
/// `/add-driver … /install` puts it in the driver store; PnP binds it when a run's QEMU presents the device).
pub fn setup_steps(kdnet: &KdnetSettings) -> Vec<SetupStep> {
    let cert = format!(r"{GUEST_DRIVER_DIR}\vhca-test.cer");
    let catalog = format!(r"{GUEST_DRIVER_DIR}\{CATALOG_FILE}");
    // Windows PowerShell's own cmdlets (no SDK in the guest). Set-AuthenticodeSignature reports a failed signature in
    // its result's Status, not its exit code, hence the explicit exit.
    let make_catalog = format!(
        r#"powershell -NoProfile -Command "New-FileCatalog -Path {GUEST_DRIVER_DIR} -CatalogFilePath {catalog} -CatalogVersion 2.0""#
    );
    let sign_catalog = format!(
        r#"powershell -NoProfile -Command "$c = Import-PfxCertificate -FilePath {GUEST_DRIVER_DIR}\vhca-test.pfx -CertStoreLocation Cert:\LocalMachine\My -Password (ConvertTo-SecureString vhca -AsPlainText -Force); if ((Set-AuthenticodeSignature -FilePath {catalog} -Certificate $c -HashAlgorithm SHA256).Status -ne 'Valid') {{ exit 1 }}""#
    );
    let crash = r"HKLM\SYSTEM\CurrentControlSet\Control\CrashControl";
    let kd = kdnet.bcdedit_commands();
    let pnputil = SetupStep {
        also_ok: PNPUTIL_ALSO_OK,
        ..step(
            "driver package into the driver store",
            format!(r"pnputil /add-driver {GUEST_DRIVER_DIR}\vhca.inf /install"),
        )
    };
    vec![
        step("test signing on", "bcdedit /set testsigning on"),
        step("test certificate into Root", format!("certutil -addstore -f Root {cert}")),
        step("test certificate into TrustedPublisher", format!("certutil -addstore -f TrustedPublisher {cert}")),
        step("driver catalog", make_catalog),
        step("driver catalog signed with the test certificate", sign_catalog),
        pnputil,
        step("KDNET debug settings", kd[0].clone()),
        step("kernel debugging on", kd[1].clone()),
        // 3: small memory dump (%SystemRoot%\Minidump), written on a bugcheck before the reboot that ends QEMU.
        step("small memory dumps", format!("reg add {crash} /v CrashDumpEnabled /t REG_DWORD /d 3 /f")),
        step("reboot after a bugcheck", format!("reg add {crash} /v AutoReboot /t REG_DWORD /d 1 /f")),
        // Updates and hibernation would rewrite the image behind the rig's back.
        step("Windows Update off", "sc config wuauserv start= disabled"),
        step("hibernation off", "powercfg /hibernate off"),
        step(
            "resident agent at every boot",
            format!(
                r#"schtasks /create /f /tn {AGENT_TASK} /sc onstart /ru SYSTEM /rl HIGHEST /tr "powershell -NoProfile -ExecutionPolicy Bypass -File {GUEST_DIR}\{AGENT_FILE}""#
            ),
        ),
    ]
}

/// `vhca-setup.ps1`: runs the steps in order, each logged to COM1 and `C:\vhca\setup.log`; stops at the first that
/// fails, naming it; powers off either way, so the recipe's QEMU ends and the recipe reads COM1 for the outcome.
pub fn setup_script(steps: &[SetupStep]) -> String {
    let mut s = String::new();
    s.push_str("# Generated by vhca-run windows-image: the one-time set-up of a vhca Windows image.\n");
    s.push_str("$ErrorActionPreference = 'Continue'\n");
    s.push_str("$com = New-Object System.IO.Ports.SerialPort 'COM1', 115200\n$com.Open()\n");
    s.push_str(&format!(
        "function Say($line) {{ $com.WriteLine($line); Add-Content -Path '{GUEST_DIR}\\setup.log' -Value $line }}\n"
    ));
    s.push_str("$steps = @(\n");
    for (i, step) in steps.iter().enumerate() {
        // Single-quoted PowerShell strings: only ' needs doubling. The leading comma keeps each step one array: inside
        // @( ), a bare @(…) per line would be flattened into the outer list.
        let ok: Vec<String> = std::iter::once(0).chain(step.also_ok.iter().copied()).map(|c| c.to_string()).collect();
        s.push_str(&format!(
            "  ,@({}, '{}', '{}', @({}))\n",
            i + 1,
            ps_quote(step.what),
            ps_quote(&step.command),
            ok.join(", ")
        ));
    }
    s.push_str(")\n");
    s.push_str(&format!(
        "$failed = $false\n\
         foreach ($s in $steps) {{\n\
         \x20 Say \"{SETUP_MARK} step $($s[0]): $($s[1])\"\n\
         \x20 $out = cmd /c \"$($s[2]) 2>&1\"\n\
         \x20 $rc = $LASTEXITCODE\n\
         \x20 $out | ForEach-Object {{ Say \"  $_\" }}\n\
         \x20 if ($s[3] -notcontains $rc) {{ Say \"{SETUP_FAILED} step $($s[0]) ($($s[1])): exit $rc\"; $failed = $true; break }}\n\
         }}\n\
         if (-not $failed) {{ Say '{SETUP_DONE}' }}\n\
         $com.Close()\n\
         shutdown /s /t 0\n"
    ));
    s
}

fn ps_quote(text: &str) -> String {
    text.replace('\'', "''")
}

/// The first logon: copy the rig's folder from the answer disc (whatever its drive letter), then run the set-up.
pub fn first_logon_commands() -> Vec<FirstLogonCommand> {
    vec![
        FirstLogonCommand {
            command_line: format!(
                r"cmd /c for %d in (D E F G H I J) do if exist %d:\{DISC_DIR}\{SETUP_FILE} xcopy /e /i /y %d:\{DISC_DIR} {GUEST_DIR}"
            ),
            description: "copy the vhca folder from the answer disc".into(),
        },
        FirstLogonCommand {
            command_line: format!(r"powershell -NoProfile -ExecutionPolicy Bypass -File {GUEST_DIR}\{SETUP_FILE}"),
            description: "vhca set-up: test signing, certificate, driver, KDNET, dumps, agent".into(),
        },
    ]
}

/// The command a boot state runs once (then the agent powers off): Driver Verifier on for vhca.sys with `flags`, or
/// every verifier setting cleared. Verifier settings take effect at the next boot, which is every run's boot.
pub fn verifier_command(flags: u32) -> String {
    if flags == 0 {
        "verifier /reset".to_string()
    } else {
        format!("verifier /flags {flags:#x} /driver vhca.sys")
    }
}

/// The boot state a run with these verifier flags starts from, as a file name in the image directory.
pub fn state_file(flags: u32) -> String {
    if flags == 0 {
        "state-verifier-off.qcow2".to_string()
    } else {
        format!("state-verifier-{flags:#x}.qcow2")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifier_states() {
        assert_eq!(verifier_command(0), "verifier /reset");
        assert_eq!(verifier_command(0xAA), "verifier /flags 0xaa /driver vhca.sys");
        assert_eq!(state_file(0), "state-verifier-off.qcow2");
        assert_eq!(state_file(0xAA), "state-verifier-0xaa.qcow2");
    }
}

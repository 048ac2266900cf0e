//! What `vhca-run debug` (and `boot --gdb`) prints: exactly what to type to attach a debugger to a paused run. For a
//! Linux guest the gdb line; for a Windows guest the KDNET port, key and WinDbg line, how the guest's KDNET packets
//! reach a debugger on another machine, and the EXDI alternative over QEMU's gdb stub. The Windows lines follow
//! Microsoft's "Set up KDNET network kernel debugging" and "Configuring the EXDI debugger transport" pages; they have
//! never been tried against a Windows guest here (no Windows image on these machines).

use std::path::Path;

use crate::windows_guest::kdnet::{KdnetSettings, SLIRP_HOST};

/// The Linux guest: gdb on the kernel's symbols against QEMU's stub.
pub fn linux_gdb_lines(symbols: &Path, gdb_port: u16, paused: bool) -> Vec<String> {
    vec![
        format!("vhca-run: gdb stub on :{gdb_port}{}; attach with:", if paused { ", guest paused" } else { "" }),
        format!("  gdb {} -ex 'target remote :{gdb_port}'", symbols.display()),
    ]
}

/// The Windows guest, paused before its first instruction until the person presses Enter.
pub fn windows_lines(kdnet: &KdnetSettings, gdb_port: u16, host: &str) -> Vec<String> {
    let port = kdnet.port;
    let mut lines = vec![
        "vhca-run: the Windows guest is paused before its first instruction. Attach a debugger, then press Enter here \
         to start it."
            .to_string(),
        String::new(),
        "KDNET (kernel debugging over the guest's e1000e; settings baked into the image):".to_string(),
        format!("  port {port}, key {}", kdnet.key),
        format!("  on the Windows machine that runs WinDbg:  {}", kdnet.windbg_line()),
    ];
    if kdnet.host_ip == SLIRP_HOST {
        lines.extend([
            format!(
                "  the guest sends to {SLIRP_HOST}, which QEMU's user network delivers to UDP port {port} of this host \
                 ({host}); relay it to the WinDbg machine:"
            ),
            format!("    socat -T 600 UDP4-LISTEN:{port},reuseaddr,fork UDP4:WINDBG_MACHINE:{port}"),
            "  (or build the image with --kdnet-host-ip WINDBG_MACHINE: the guest then sends there through QEMU's NAT)"
                .to_string(),
        ]);
    } else {
        lines.push(format!(
            "  the guest sends to {} (the image's --kdnet-host-ip) through QEMU's NAT: run WinDbg there, UDP port {port} \
             open",
            kdnet.host_ip
        ));
    }
    lines.extend([
        String::new(),
        "EXDI over QEMU's gdb stub (nothing in the guest; fewer kernel facts than KDNET):".to_string(),
        format!("  gdb stub on {host}:{gdb_port} (from elsewhere: ssh -L {gdb_port}:localhost:{gdb_port} {host})"),
        format!(
            "  WinDbg 1.2410.11001.0 or later (it has the EXDI dialog): attach to kernel over EXDI, QEMU target, address \
             {host}:{gdb_port}"
        ),
    ]);
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::windows_guest::kdnet::KdnetKey;
    use std::net::Ipv4Addr;

    #[test]
    fn linux_line_is_the_gdb_command() {
        let lines = linux_gdb_lines(Path::new("/cache/img/vmlinux"), 1234, true);
        assert_eq!(lines[0], "vhca-run: gdb stub on :1234, guest paused; attach with:");
        assert_eq!(lines[1], "  gdb /cache/img/vmlinux -ex 'target remote :1234'");
        assert_eq!(linux_gdb_lines(Path::new("v"), 9, false)[0], "vhca-run: gdb stub on :9; attach with:");
    }

    #[test]
    fn windows_lines_give_port_key_windbg_relay_and_exdi() {
        let key = KdnetKey::parse("1a.2b.3c.4d").unwrap();
        let kd = KdnetSettings::new(SLIRP_HOST, 50000, key.clone()).unwrap();
        let text = windows_lines(&kd, 1234, "rig7").join("\n");
        for want in [
            "port 50000, key 1a.2b.3c.4d",
            "windbg -k net:port=50000,key=1a.2b.3c.4d",
            "socat -T 600 UDP4-LISTEN:50000,reuseaddr,fork UDP4:WINDBG_MACHINE:50000",
            "gdb stub on rig7:1234",
            "ssh -L 1234:localhost:1234 rig7",
            "attach to kernel over EXDI, QEMU target, address rig7:1234",
            "press Enter",
        ] {
            assert!(text.contains(want), "missing {want:?} in:\n{text}");
        }
        let direct = KdnetSettings::new(Ipv4Addr::new(192, 168, 1, 9), 50001, key).unwrap();
        let text = windows_lines(&direct, 1234, "rig7").join("\n");
        assert!(text.contains("the guest sends to 192.168.1.9"), "{text}");
        assert!(!text.contains("socat"), "no relay when the guest sends to the debugger itself");
    }
}

//! Run options from the kernel command line: every `vhca.<key>=<value>` word, parsed once, up front.
//! Unknown keys and bad values are collected as warnings for the report instead of stopping the run.

use std::fmt;

/// PCI identity of the device to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciId {
    pub vendor: u16,
    pub device: u16,
}

impl PciId {
    /// Parses `vvvv:dddd` in hex, as lspci prints it.
    pub fn parse(text: &str) -> Option<PciId> {
        let (vendor, device) = text.split_once(':')?;
        let vendor = u16::from_str_radix(vendor.trim_start_matches("0x"), 16).ok()?;
        let device = u16::from_str_radix(device.trim_start_matches("0x"), 16).ok()?;
        Some(PciId { vendor, device })
    }
}

impl fmt::Display for PciId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:04x}", self.vendor, self.device)
    }
}

/// What the run does and how long it may wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Scenario name; only `smoke` exists so far.
    pub scenario: String,
    /// Bound on every wait for the device (reset, one command completion).
    pub timeout_ms: u64,
    /// Drive exactly this device instead of the vhca ids (e.g. `1af4:1044`, QEMU's virtio-rng, to test the transport).
    pub device: Option<PciId>,
    /// Power the machine off at the end; `vhca.poweroff=0` keeps an interactive guest alive for debugging.
    pub poweroff: bool,
    /// Written to the device's sysfs reset_method before vfio-pci opens it (e.g. `pm`); None keeps the kernel's.
    pub reset_method: Option<String>,
    /// Words with the `vhca.` prefix this program does not understand, or whose value did not parse.
    pub warnings: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            scenario: "smoke".into(),
            timeout_ms: 5000,
            device: None,
            poweroff: true,
            reset_method: None,
            warnings: Vec::new(),
        }
    }
}

const PREFIX: &str = "vhca.";

impl Options {
    /// Parses a whole kernel command line; words without the `vhca.` prefix belong to others and are ignored.
    pub fn parse(cmdline: &str) -> Options {
        let mut options = Options::default();
        for word in cmdline.split_whitespace() {
            let Some(setting) = word.strip_prefix(PREFIX) else { continue };
            let (key, value) = setting.split_once('=').unwrap_or((setting, ""));
            if let Err(why) = options.apply(key, value) {
                options.warnings.push(format!("{PREFIX}{key}: {why}"));
            }
        }
        options
    }

    fn apply(&mut self, key: &str, value: &str) -> Result<(), String> {
        match key {
            "scenario" if !value.is_empty() => self.scenario = value.to_string(),
            "scenario" => return Err("empty value".into()),
            "timeout_ms" => {
                self.timeout_ms =
                    value.parse().ok().filter(|ms| *ms > 0).ok_or(format!("not a positive integer: {value:?}"))?
            }
            "device" => self.device = Some(PciId::parse(value).ok_or(format!("not vvvv:dddd in hex: {value:?}"))?),
            "poweroff" => {
                self.poweroff = match value {
                    "1" | "on" | "yes" | "true" => true,
                    "0" | "off" | "no" | "false" => false,
                    _ => return Err(format!("not a boolean: {value:?}")),
                }
            }
            "reset_method" if !value.is_empty() => self.reset_method = Some(value.to_string()),
            "reset_method" => return Err("empty value".into()),
            // Read by the initramfs' /init (probe / hang modes), not by this program.
            "init" => {}
            _ => return Err("unknown key".into()),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_when_nothing_is_given() {
        let options = Options::parse("console=ttyS0 intel_iommu=on panic=-1 quiet");
        assert_eq!(options, Options::default());
    }

    #[test]
    fn reads_every_known_key() {
        let options = Options::parse(
            "quiet vhca.init=guest vhca.scenario=cq-fallback vhca.timeout_ms=250 vhca.device=1af4:1044 vhca.poweroff=0 vhca.reset_method=pm",
        );
        assert_eq!(options.scenario, "cq-fallback");
        assert_eq!(options.timeout_ms, 250);
        assert_eq!(options.device, Some(PciId { vendor: 0x1af4, device: 0x1044 }));
        assert!(!options.poweroff);
        assert_eq!(options.reset_method.as_deref(), Some("pm"));
        assert!(options.warnings.is_empty(), "{:?}", options.warnings);
    }

    #[test]
    fn unknown_keys_and_bad_values_become_warnings_and_keep_defaults() {
        let options =
            Options::parse("vhca.colour=blue vhca.timeout_ms=soon vhca.timeout_ms=0 vhca.device=1af4 vhca.scenario=");
        assert_eq!(options.timeout_ms, Options::default().timeout_ms);
        assert_eq!(options.device, None);
        assert_eq!(options.scenario, "smoke");
        assert_eq!(options.warnings.len(), 5, "{:?}", options.warnings);
        assert!(options.warnings[0].contains("vhca.colour"));
        assert!(options.warnings[1].contains("soon"));
    }

    #[test]
    fn pci_id_round_trips_through_display() {
        let id = PciId::parse("0x1AF4:1059").unwrap();
        assert_eq!(id, PciId { vendor: 0x1af4, device: 0x1059 });
        assert_eq!(id.to_string(), "1af4:1059");
        assert_eq!(PciId::parse("1af4:10599"), None);
    }
}

//! KDNET, Windows' kernel debugger over the network: the key the image is built with, the `bcdedit` commands that set
//! it in the guest, and the `windbg -k net:…` line a person types. Microsoft's references: "BCDEdit /dbgsettings"
//! (NET HOSTIP:ip PORT:port KEY:key; port 49152 or above; key characters [0-9a-z]) and "Set up KDNET network kernel
//! debugging automatically" (a key is four dot-separated words). Never run here: these machines have no Windows.

use std::fmt;
use std::io::Read;
use std::net::Ipv4Addr;

/// The lowest port `bcdedit /dbgsettings net` accepts.
pub const MIN_PORT: u16 = 49152;
/// The port images are built with unless the user picks another.
pub const DEFAULT_PORT: u16 = 50000;
/// The address of the QEMU host as the guest sees it behind QEMU's user-mode network (slirp's gateway): KDNET's
/// packets to it arrive on the host's own port, where WinDbg or a relay listens.
pub const SLIRP_HOST: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);

/// A KDNET key: four words of base-36 digits, each one 64-bit number (up to 13 digits), 256 bits in all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KdnetKey(String);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KdnetError {
    #[error("KDNET key {0:?}: expected four dot-separated words of 1 to 13 characters from [0-9a-z]")]
    BadKey(String),
    #[error("KDNET port {0}: bcdedit /dbgsettings net takes {MIN_PORT} or above")]
    BadPort(u16),
}

impl KdnetKey {
    /// Four random 64-bit words from the kernel's random source, written in base 36 as Windows' own `newkey` keys are.
    pub fn generate() -> std::io::Result<KdnetKey> {
        let mut bytes = [0u8; 32];
        // std has no random source of its own; /dev/urandom is the kernel's, and four words need no crate.
        std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
        Ok(KdnetKey::from_words(std::array::from_fn(|i| {
            u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap_or_default())
        })))
    }

    pub fn from_words(words: [u64; 4]) -> KdnetKey {
        KdnetKey(words.iter().map(|w| base36(*w)).collect::<Vec<_>>().join("."))
    }

    /// A key as a user or an image's metadata gives it, checked against bcdedit's rules.
    pub fn parse(text: &str) -> Result<KdnetKey, KdnetError> {
        let words: Vec<&str> = text.split('.').collect();
        let ok = words.len() == 4
            && words.iter().all(|w| {
                (1..=13).contains(&w.len()) && w.chars().all(|c| c.is_ascii_digit() || c.is_ascii_lowercase())
            });
        if ok {
            Ok(KdnetKey(text.to_string()))
        } else {
            Err(KdnetError::BadKey(text.to_string()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for KdnetKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn base36(mut n: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}

/// Where the guest's KDNET sends its packets, and the key both ends use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KdnetSettings {
    /// The debugger host as the guest reaches it: `SLIRP_HOST` (the QEMU host) unless the image names another.
    pub host_ip: Ipv4Addr,
    pub port: u16,
    pub key: KdnetKey,
}

impl KdnetSettings {
    pub fn new(host_ip: Ipv4Addr, port: u16, key: KdnetKey) -> Result<KdnetSettings, KdnetError> {
        if port < MIN_PORT {
            return Err(KdnetError::BadPort(port));
        }
        Ok(KdnetSettings { host_ip, port, key })
    }

    /// The guest side, run once in the image: debug settings, then the debugger on for the boot entry. `{default}`
    /// is the entry the image boots; no `busparams`, so KDNET picks the one supported NIC (the e1000e).
    pub fn bcdedit_commands(&self) -> Vec<String> {
        vec![
            format!("bcdedit /dbgsettings net hostip:{} port:{} key:{}", self.host_ip, self.port, self.key),
            "bcdedit /debug {default} on".to_string(),
        ]
    }

    /// What the person at the debugger types (WinDbg; `kd -k` takes the same string).
    pub fn windbg_line(&self) -> String {
        format!("windbg -k net:port={},key={}", self.port, self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_four_base36_words_that_parse_back() {
        let key = KdnetKey::from_words([0, 35, 36, u64::MAX]);
        assert_eq!(key.as_str(), "0.z.10.3w5e11264sgsf");
        assert_eq!(KdnetKey::parse(key.as_str()), Ok(key));
        let a = KdnetKey::generate().unwrap();
        let b = KdnetKey::generate().unwrap();
        assert_ne!(a, b, "two generated keys are the same: the random source is not random");
        assert_eq!(KdnetKey::parse(a.as_str()), Ok(a));
    }

    #[test]
    fn bad_keys_and_ports_are_refused() {
        for bad in ["1.2.3", "1.2.3.4.5", "A.b.c.d", "1..3.4", "1.2.3.44444444444444", "1.2.3.4 "] {
            assert!(KdnetKey::parse(bad).is_err(), "{bad}");
        }
        let key = KdnetKey::parse("1.2.3.4").unwrap();
        assert_eq!(KdnetSettings::new(SLIRP_HOST, 50, key.clone()), Err(KdnetError::BadPort(50)));
        assert!(KdnetSettings::new(SLIRP_HOST, MIN_PORT, key).is_ok());
    }

    #[test]
    fn guest_commands_and_debugger_line() {
        let s = KdnetSettings::new(SLIRP_HOST, 50000, KdnetKey::parse("a.b.c.d").unwrap()).unwrap();
        assert_eq!(
            s.bcdedit_commands(),
            ["bcdedit /dbgsettings net hostip:10.0.2.2 port:50000 key:a.b.c.d", "bcdedit /debug {default} on"]
        );
        assert_eq!(s.windbg_line(), "windbg -k net:port=50000,key=a.b.c.d");
    }
}

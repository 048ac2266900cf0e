//! The registry's keys and values a driver binary sees, and the key handles it holds open: a table the run fills
//! (the service's Parameters key with `Scenario`) and `registry_thunks` reads and writes for the driver.

use std::collections::HashMap;
use std::sync::Mutex;

/// Kernel handles are above this (their high bit set on Windows; any unique value serves here).
const HANDLE_BASE: usize = 0xFFFF_FFFF_8000_0000;

pub const REG_SZ: u32 = 1;

/// value name (lower case) -> (type, data)
type Values = HashMap<String, (u32, Vec<u8>)>;

/// Key and value names compare without case, as Windows'.
#[derive(Default)]
pub struct Registry {
    /// key path (lower case) -> its values
    keys: Mutex<HashMap<String, Values>>,
    handles: Mutex<HashMap<usize, String>>,
}

impl Registry {
    /// Creates `key` (if new) with `value` = `data` of `kind`.
    pub fn set(&self, key: &str, value: &str, kind: u32, data: Vec<u8>) {
        crate::lock(&self.keys).entry(key.to_lowercase()).or_default().insert(value.to_lowercase(), (kind, data));
    }

    /// A REG_SZ value: UTF-16 with its terminating NUL, as RegSetValueEx stores one.
    pub fn set_string(&self, key: &str, value: &str, text: &str) {
        let bytes = text.encode_utf16().chain([0]).flat_map(u16::to_le_bytes).collect();
        self.set(key, value, REG_SZ, bytes)
    }

    /// A REG_SZ value as text, without its NUL.
    pub fn string(&self, key: &str, value: &str) -> Option<String> {
        let (_, data) = self.value(key, value)?;
        let units: Vec<u16> = data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        Some(String::from_utf16_lossy(&units).trim_end_matches('\0').to_string())
    }

    /// The (type, data) of `value` under `key`.
    pub fn value(&self, key: &str, value: &str) -> Option<(u32, Vec<u8>)> {
        crate::lock(&self.keys).get(&key.to_lowercase())?.get(&value.to_lowercase()).cloned()
    }

    /// A new handle to `key`, or None when there is no such key.
    pub fn open(&self, key: &str) -> Option<usize> {
        let key = key.to_lowercase();
        if !crate::lock(&self.keys).contains_key(&key) {
            return None;
        }
        let mut handles = crate::lock(&self.handles);
        let handle = HANDLE_BASE + handles.len() * 4 + 4;
        handles.insert(handle, key);
        Some(handle)
    }

    /// The key an open handle names.
    pub fn key_of(&self, handle: usize) -> Option<String> {
        crate::lock(&self.handles).get(&handle).cloned()
    }

    /// Closes `handle`; false when it was not open.
    pub fn close(&self, handle: usize) -> bool {
        crate::lock(&self.handles).remove(&handle).is_some()
    }
}

//! Names for vhca.sys's sites in what a run reports. The guest names a site in the binary by its RVA
//! (`vhca.sys+0x180e0`) and the nearest symbol it has, but its image carries vhca.sys without vhca.pdb (7 MB the
//! guest would read at every run), so that symbol is the entry point. The runner has the PDB beside the package it
//! built the image from: each `vhca.sys+0xRVA` in the guest's result (race reports, schedule points, preemptions,
//! errors) gets the PDB's routine instead, `vhca.sys+0x180e0 (vhca_scenarios::two_requests::run+0x40)`.

use std::path::Path;
use std::sync::OnceLock;

use serde_json::Value;
use vhca_loader::driver_symbols::DriverSymbols;
use vhca_loader::pe_image::PeImage;

const IMAGE: &str = "vhca.sys+0x";

/// The symbols of the package this runner finds (`paths::driver_package`), read once per process.
pub fn package_names() -> Option<&'static SiteNames> {
    static NAMES: OnceLock<Option<SiteNames>> = OnceLock::new();
    NAMES.get_or_init(|| crate::paths::driver_package().and_then(|dir| SiteNames::of_package(&dir))).as_ref()
}

/// The package's symbols: its vhca.pdb, and vhca.sys's entry point.
pub struct SiteNames {
    symbols: DriverSymbols,
}

impl SiteNames {
    /// The symbols of the package in `dir` (vhca.sys and vhca.pdb); None when either is missing or unreadable.
    pub fn of_package(dir: &Path) -> Option<SiteNames> {
        let pdb = dir.join("vhca.pdb");
        let image = std::fs::read(dir.join("vhca.sys")).ok()?;
        let entry = PeImage::parse(&image).ok()?.entry_rva;
        let symbols = DriverSymbols::load(&pdb, entry);
        // Only the entry point: the PDB did not read, and the guest's name is as good.
        (pdb.is_file() && symbols.len() > 1).then_some(SiteNames { symbols })
    }

    #[cfg(test)]
    fn of(symbols: DriverSymbols) -> SiteNames {
        SiteNames { symbols }
    }

    /// `text` with each `vhca.sys+0xRVA` named by the PDB's routine, in place of whatever name followed it in
    /// parentheses.
    pub fn rename(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len() + 32);
        let mut rest = text;
        while let Some(at) = rest.find(IMAGE) {
            let digits = rest[at + IMAGE.len()..]
                .find(|c: char| !c.is_ascii_hexdigit())
                .map_or(rest.len(), |n| at + IMAGE.len() + n);
            out.push_str(&rest[..digits]);
            let Ok(rva) = u32::from_str_radix(&rest[at + IMAGE.len()..digits], 16) else {
                rest = &rest[digits..];
                continue;
            };
            rest = skip_name(&rest[digits..]);
            if let Some((name, offset)) = self.symbols.nearest(rva) {
                out.push_str(&format!(" ({:#}+{offset:#x})", rustc_demangle::demangle(name)));
            }
        }
        out.push_str(rest);
        out
    }

    /// Every string in `value` renamed.
    pub fn rename_all(&self, value: &mut Value) {
        match value {
            Value::String(text) if text.contains(IMAGE) => *text = self.rename(text),
            Value::Array(items) => items.iter_mut().for_each(|v| self.rename_all(v)),
            Value::Object(fields) => fields.values_mut().for_each(|v| self.rename_all(v)),
            _ => {}
        }
    }
}

/// `rest` past a ` (name)` the guest put after a site (its parentheses may nest: `(DriverEntry (entry point)+0x10)`).
fn skip_name(rest: &str) -> &str {
    let Some(inner) = rest.strip_prefix(" (") else { return rest };
    let mut depth = 1;
    for (i, c) in inner.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return &inner[i + 1..];
                }
            }
            _ => {}
        }
    }
    rest
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The package ci/build-windows.sh built, when this checkout has one.
    fn built() -> Option<&'static SiteNames> {
        package_names()
    }

    #[test]
    fn a_site_takes_the_pdbs_routine_in_place_of_the_guests_name() {
        let Some(names) = built() else {
            assert!(std::env::var("CI").as_deref() != Ok("true"), "CI builds vhca.sys and its PDB first");
            return;
        };
        let text = "main write on processor 0 at vhca.sys+0x180e0 (DriverEntry (entry point)+0x170e0), then";
        let renamed = names.rename(text);
        assert!(renamed.starts_with("main write on processor 0 at vhca.sys+0x180e0 ("), "{renamed}");
        assert!(!renamed.contains("DriverEntry (entry point)+0x170e0"), "{renamed}");
        assert!(!renamed.contains("_ZN"), "demangled: {renamed}");
        assert!(renamed.ends_with("), then"), "{renamed}");
    }

    #[test]
    fn without_a_pdb_the_entry_point_names_sites_and_text_around_them_is_kept() {
        let names = SiteNames::of(DriverSymbols::entry_only(0x1000));
        assert_eq!(
            names.rename("at vhca.sys+0x1010 < vhca.sys+0x1020 (old (nested)+0x1) and vhca.sys+0xzz, vhca.sys+0x10"),
            "at vhca.sys+0x1010 (DriverEntry (entry point)+0x10) < vhca.sys+0x1020 (DriverEntry (entry point)+0x20) \
             and vhca.sys+0xzz, vhca.sys+0x10"
        );
        let mut value = serde_json::json!({"races": [{"site": "vhca.sys+0x1004 (x)"}], "n": 3});
        names.rename_all(&mut value);
        assert_eq!(
            value,
            serde_json::json!({"races": [{"site": "vhca.sys+0x1004 (DriverEntry (entry point)+0x4)"}], "n": 3})
        );
    }
}

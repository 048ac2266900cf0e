//! Names for addresses in the driver: the PDB's public symbols and its modules' procedures when the PDB is there
//! (vhca.pdb ships beside vhca.sys), else the image's entry point, so a fault inside the driver names the routine
//! it happened in. Procedures matter: a routine the linker keeps private (a callback only reached through a pointer,
//! such as AddDevice) has no public symbol.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use pdb::{FallibleIterator, SymbolData, PDB};

/// Sorted (rva, name) pairs, read from the PDB the first time a name is asked for: parsing vhca.pdb (7 MB) takes
/// 10-30 ms on the host and several times that in a TCG guest, and a run needs a name only when the driver faults
/// (issue 13's speed target; docs/bench.md).
#[derive(Debug, Default)]
pub struct DriverSymbols {
    entry_rva: u32,
    pdb: Option<PathBuf>,
    symbols: OnceLock<Vec<(u32, String)>>,
}

impl DriverSymbols {
    /// Only the entry point: what an image without its PDB can say.
    pub fn entry_only(entry_rva: u32) -> DriverSymbols {
        DriverSymbols { entry_rva, pdb: None, symbols: OnceLock::new() }
    }

    /// The PDB's public symbols and procedures plus the entry point, read when first needed; the entry point alone
    /// when the PDB cannot be read.
    pub fn load(pdb_path: &Path, entry_rva: u32) -> DriverSymbols {
        DriverSymbols { entry_rva, pdb: Some(pdb_path.to_path_buf()), symbols: OnceLock::new() }
    }

    fn symbols(&self) -> &[(u32, String)] {
        self.symbols.get_or_init(|| {
            let mut symbols = vec![(self.entry_rva, "DriverEntry (entry point)".to_string())];
            if let Some(path) = &self.pdb {
                symbols.extend(read_publics(path).unwrap_or_default());
                symbols.extend(read_procedures(path).unwrap_or_default());
            }
            symbols.sort();
            symbols.dedup_by_key(|(rva, _)| *rva);
            symbols
        })
    }

    /// The symbol at or below `rva` and the offset into it.
    pub fn nearest(&self, rva: u32) -> Option<(&str, u32)> {
        let symbols = self.symbols();
        let at = symbols.partition_point(|(r, _)| *r <= rva);
        at.checked_sub(1).map(|i| (symbols[i].1.as_str(), rva - symbols[i].0))
    }

    /// The RVA of the first symbol whose name satisfies `pick`.
    pub fn rva_of(&self, pick: impl Fn(&str) -> bool) -> Option<u32> {
        self.symbols().iter().find(|(_, name)| pick(name)).map(|(rva, _)| *rva)
    }

    pub fn len(&self) -> usize {
        self.symbols().len()
    }

    pub fn is_empty(&self) -> bool {
        self.symbols().is_empty()
    }
}

fn read_publics(path: &Path) -> pdb::Result<Vec<(u32, String)>> {
    let mut pdb = PDB::open(File::open(path)?)?;
    let address_map = pdb.address_map()?;
    let globals = pdb.global_symbols()?;
    let mut out = Vec::new();
    let mut iter = globals.iter();
    while let Some(symbol) = iter.next()? {
        if let Ok(SymbolData::Public(p)) = symbol.parse() {
            if let Some(rva) = p.offset.to_rva(&address_map) {
                out.push((rva.0, p.name.to_string().into_owned()));
            }
        }
    }
    Ok(out)
}

/// Every module's procedure symbols (S_GPROC32 / S_LPROC32), by their names as the compiler wrote them.
fn read_procedures(path: &Path) -> pdb::Result<Vec<(u32, String)>> {
    let mut pdb = PDB::open(File::open(path)?)?;
    let address_map = pdb.address_map()?;
    let info = pdb.debug_information()?;
    let mut modules = info.modules()?;
    let mut out = Vec::new();
    while let Some(module) = modules.next()? {
        let Some(module_info) = pdb.module_info(&module)? else { continue };
        let mut symbols = module_info.symbols()?;
        while let Some(symbol) = symbols.next()? {
            if let Ok(SymbolData::Procedure(p)) = symbol.parse() {
                if let Some(rva) = p.offset.to_rva(&address_map) {
                    out.push((rva.0, p.name.to_string().into_owned()));
                }
            }
        }
    }
    Ok(out)
}

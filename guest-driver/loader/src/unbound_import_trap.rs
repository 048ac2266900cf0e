//! For running a driver whose imports the model does not all implement yet (tests and `vhca-load --trap-unbound`):
//! each such import is bound to a generated stub that, if the driver ever calls it, ends the run with a line naming
//! the routine. The guest never uses this: there an unbound import refuses the load, as Windows refuses the driver.
//! Hand-written: generating call stubs is a dozen bytes of x86-64 no crate is needed for.

use std::sync::Mutex;

use crate::image_mapping::ImportResolver;

/// Bytes per stub: `mov rcx, imm64` (10) + `mov rax, imm64` (10) + `jmp rax` (2), padded.
const STUB: usize = 32;
const PAGE: usize = 4096;

/// Resolves through `inner`; what `inner` lacks gets a trap stub.
pub struct TrapUnbound<R> {
    inner: R,
    names: Mutex<Vec<String>>,
    stubs: *mut u8,
    capacity: usize,
}

// SAFETY: the stub page is written only while resolving (under `names`' lock) and is read-execute after `seal`.
unsafe impl<R: Send> Send for TrapUnbound<R> {}
// SAFETY: as above.
unsafe impl<R: Sync> Sync for TrapUnbound<R> {}

static TRAPPED: Mutex<Vec<String>> = Mutex::new(Vec::new());

impl<R: ImportResolver> TrapUnbound<R> {
    pub fn new(inner: R) -> TrapUnbound<R> {
        let capacity = 4 * PAGE / STUB;
        // SAFETY: a fresh private anonymous mapping.
        let stubs = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4 * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(stubs, libc::MAP_FAILED, "cannot map the trap stubs");
        TrapUnbound { inner, names: Mutex::new(Vec::new()), stubs: stubs as *mut u8, capacity }
    }

    /// The routines that got a trap instead of a thunk.
    pub fn unbound(&self) -> Vec<String> {
        crate::lock(&self.names).clone()
    }

    /// Makes the stubs executable (and no longer writable): call after mapping the image.
    pub fn seal(&self) {
        *crate::lock(&TRAPPED) = self.unbound();
        // SAFETY: our own mapping.
        let r = unsafe { libc::mprotect(self.stubs as *mut libc::c_void, 4 * PAGE, libc::PROT_READ | libc::PROT_EXEC) };
        assert_eq!(r, 0, "cannot protect the trap stubs");
    }
}

impl<R: ImportResolver> ImportResolver for TrapUnbound<R> {
    fn resolve(&self, module: &str, name: &str) -> Option<usize> {
        if let Some(address) = self.inner.resolve(module, name) {
            return Some(address);
        }
        let mut names = crate::lock(&self.names);
        let index = names.len();
        if index >= self.capacity {
            return None;
        }
        names.push(format!("{module}!{name}"));
        let mut code = Vec::with_capacity(STUB);
        code.extend_from_slice(&[0x48, 0xB9]);
        code.extend_from_slice(&(index as u64).to_le_bytes());
        code.extend_from_slice(&[0x48, 0xB8]);
        code.extend_from_slice(&(unbound_import_called as extern "win64" fn(u64) -> ! as usize as u64).to_le_bytes());
        code.extend_from_slice(&[0xFF, 0xE0]);
        // SAFETY: stub `index` lies inside the writable stub mapping (index < capacity).
        unsafe { std::ptr::copy_nonoverlapping(code.as_ptr(), self.stubs.add(index * STUB), code.len()) };
        // SAFETY: as above.
        Some(unsafe { self.stubs.add(index * STUB) } as usize)
    }
}

/// Where every trap stub lands: the run ends naming the routine, never a silent jump into nothing.
extern "win64" fn unbound_import_called(index: u64) -> ! {
    let name = crate::lock(&TRAPPED).get(index as usize).cloned().unwrap_or_else(|| format!("import #{index}"));
    println!("VHCA-LOADER: the driver called {name}, which the NT model does not implement");
    std::process::exit(crate::EXIT_UNBOUND_IMPORT)
}

//! A user process in the model: its own user memory (the NT model's user regions, below MmHighestUserAddress, at the
//! process addresses the driver binary is handed), the files it opens, the context its requests run in, and its exit.

use std::cell::Cell;
use std::sync::Mutex;

use vhca_ntapi::{DRIVER_LEFT_LOCKED_PAGES_IN_PROCESS, PAGE_SIZE, PROCESS_HAS_LOCKED_PAGES, PVOID};
use vhca_ntmodel::VerifierFlags;
use windows_sys::Wdk::Foundation::DEVICE_OBJECT;
use windows_sys::Win32::Foundation::NTSTATUS;

use crate::io_manager::top_of;
use crate::kernel_context::{bugcheck, kernel};
use crate::user_requests::{take_stuck, IoctlReply, Sent, UserFile};

/// STATUS_NO_SUCH_DEVICE (ntstatus.h): no enabled interface to open, as CreateFile on a missing link fails.
const STATUS_NO_SUCH_DEVICE: NTSTATUS = 0xC000_000E_u32 as i32;

thread_local! {
    /// The process whose context this thread runs in: 0 is the System process (PnP, work items, DPCs' arbitrary
    /// context), otherwise a UserProcess's object address. A request runs in its sender's context, as a dispatch
    /// routine at the top of a stack does on Windows.
    static ATTACHED: Cell<usize> = const { Cell::new(0) };
}

/// Each live user process's memory, by process address: (process, start, end). A UserMode probe from one context
/// of another's memory is an access violation (memory_thunks.rs asks `user_probe_allowed`).
static RANGES: Mutex<Vec<(usize, usize, usize)>> = Mutex::new(Vec::new());

/// The process this thread's requests run for (0: System).
pub fn attached() -> usize {
    ATTACHED.with(Cell::get)
}

/// Whether a UserMode probe of `len` bytes at process address `at` may go on to the model's own checks (which
/// refuse kernel memory and unmapped addresses): in a user process's context only its own memory; in System's
/// context any memory no user process owns (the seed's system-process buffers, ZwAllocateVirtualMemory's).
pub fn user_probe_allowed(at: usize, len: usize) -> bool {
    let Some(end) = at.checked_add(len) else { return false };
    let current = attached();
    let ranges = crate::lock(&RANGES);
    if current == 0 {
        return !ranges.iter().any(|&(_, start, stop)| at < stop && start < end);
    }
    ranges.iter().any(|&(process, start, stop)| process == current && start <= at && end <= stop)
}

/// A program the life runs as a user process between START_DEVICE and REMOVE (the guest program plans it): what it
/// returns is the run's, and its process exits after it either way.
pub type UserProgram = Box<dyn FnOnce(&mut UserProcess) -> Result<(), String> + Send>;

static PLANNED: Mutex<Option<UserProgram>> = Mutex::new(None);
static OUTCOME: Mutex<Option<Result<(), String>>> = Mutex::new(None);

pub fn plan(program: UserProgram) {
    *crate::lock(&PLANNED) = Some(program);
}

/// What the last life's user program answered (None: none was planned, or START was not reached).
pub fn outcome() -> Option<Result<(), String>> {
    crate::lock(&OUTCOME).clone()
}

/// The planned program, if any, in a new process on the started device `pdo`; then the process exits.
pub(crate) fn run_planned(pdo: *mut DEVICE_OBJECT) {
    let Some(program) = crate::lock(&PLANNED).take() else { return };
    let mut process = UserProcess::new(pdo);
    let result = program(&mut process);
    // The program's requests were dropped with it: one its driver never completed keeps the process from exiting.
    let stuck = take_stuck();
    let result = match (result, stuck.is_empty()) {
        (result, true) => result,
        (Ok(()), false) => Err(format!("the process cannot exit: {}", stuck.join("; "))),
        (Err(e), false) => Err(format!("{e}; and the process cannot exit: {}", stuck.join("; "))),
    };
    process.exit();
    *crate::lock(&OUTCOME) = Some(result);
}

/// One user process: its object (what 0x76 names), its memory and its open files.
pub struct UserProcess {
    /// Stands for the EPROCESS: its address is the process's identity and Parameter 2 of 0x76.
    object: Box<[u64; 16]>,
    pdo: *mut DEVICE_OBJECT,
    /// (model address, process address, bytes) of each allocation.
    memory: Vec<(PVOID, usize, usize)>,
    files: Vec<UserFile>,
}

impl UserProcess {
    pub fn new(pdo: *mut DEVICE_OBJECT) -> UserProcess {
        UserProcess { object: Box::new([0; 16]), pdo, memory: Vec::new(), files: Vec::new() }
    }

    /// The device's PDO this process opens the interface of (a second process on the same device starts from it).
    pub fn pdo(&self) -> *mut DEVICE_OBJECT {
        self.pdo
    }

    /// The process object's address: what 0x76's Parameter 2 names.
    pub fn id(&self) -> usize {
        &*self.object as *const [u64; 16] as usize
    }

    /// Runs `f` in this process's context, as KeStackAttachProcess does (and a request's dispatch routine is).
    pub fn in_context<R>(&self, f: impl FnOnce() -> R) -> R {
        let before = ATTACHED.with(|a| a.replace(self.id()));
        let out = f();
        ATTACHED.with(|a| a.set(before));
        out
    }

    /// VirtualAlloc: `bytes` of this process's own pageable memory, `in_page_offset` into its first page (a user
    /// buffer seldom starts a page); its process address. None when the model has no memory left.
    pub fn allocate(&mut self, bytes: usize, in_page_offset: usize) -> Option<usize> {
        let k = kernel();
        let va = k.model.alloc_user_buffer(bytes as u64, in_page_offset as u64);
        if va.is_null() {
            return None;
        }
        let at = k.addresses.to_host(&k.model, va);
        self.memory.push((va, at, bytes));
        let first = at - at % PAGE_SIZE as usize;
        let pages = (at - first + bytes).div_ceil(PAGE_SIZE as usize);
        crate::lock(&RANGES).push((self.id(), first, first + pages * PAGE_SIZE as usize));
        Some(at)
    }

    /// CreateFile on the device's enabled interface: CREATE in this process's context. Returns the file's index.
    pub fn open_interface(&mut self) -> Result<usize, NTSTATUS> {
        let pdo = self.pdo as usize;
        if !crate::device_interfaces::all().iter().any(|i| i.pdo == pdo && i.enabled) {
            return Err(STATUS_NO_SUCH_DEVICE);
        }
        // SAFETY: the PDO of the started stack the life runs this program on.
        let top = unsafe { top_of(self.pdo) };
        let file = self.in_context(|| UserFile::create(top))?;
        self.files.push(file);
        Ok(self.files.len() - 1)
    }

    /// DeviceIoControl on file `file`, in this process's context; `output` at a process address of this process
    /// (the direct methods' MDL is built and locked from it) or a local buffer for METHOD_BUFFERED.
    pub fn device_control(&self, file: usize, code: u32, input: &[u8], output: &mut [u8]) -> IoctlReply {
        self.in_context(|| self.files[file].device_control(code, input, output))
    }

    /// DeviceIoControl on an overlapped handle (`device_control`'s buffers): the reply, or the request the driver
    /// left pending, to wait for or cancel (CancelIoEx). One still pending when dropped is cancelled and waited for,
    /// as a thread's exit does to its requests.
    pub fn device_control_overlapped<'a>(
        &self,
        file: usize,
        code: u32,
        input: &[u8],
        output: &'a mut [u8],
    ) -> Sent<'a> {
        self.in_context(|| self.files[file].device_control_overlapped(code, input, output))
    }

    /// The process's end: its handles closed (CLEANUP in its context, then CLOSE), then its address space torn
    /// down, where the memory manager stops the machine if a driver left pages of it locked: 0x76 (0, the process,
    /// the locked pages, 0), or 0xCB under Pool Tracking, which tracks each locked MDL (docs/verifier.md).
    pub fn exit(mut self) {
        for file in std::mem::take(&mut self.files) {
            self.in_context(|| file.close());
        }
        let locked = self.locked_mdls();
        if let Some(&(mdl, _)) = locked.first() {
            let pages: u64 = locked.iter().map(|(_, pages)| pages).sum();
            if kernel().model.verifier().0 & VerifierFlags::POOL_TRACKING.0 != 0 {
                // P1, the tracker's entry: the model keeps none apart from the MDL, so it is the MDL's table slot.
                bugcheck(DRIVER_LEFT_LOCKED_PAGES_IN_PROCESS, mdl as u64, 0, mdl as u64, locked[0].1);
            }
            bugcheck(PROCESS_HAS_LOCKED_PAGES, 0, self.id() as u64, pages, 0);
        }
        let k = kernel();
        let id = self.id();
        crate::lock(&RANGES).retain(|&(process, _, _)| process != id);
        for (va, at, _) in self.memory.drain(..) {
            k.model.free_user_buffer(va);
            k.addresses.forget(at);
        }
    }

    /// The driver's MDLs still locked over this process's memory, with the pages each spans.
    fn locked_mdls(&self) -> Vec<(usize, u64)> {
        let mine = |at: usize| self.memory.iter().any(|&(_, start, bytes)| start <= at && at < start + bytes.max(1));
        let mut out = Vec::new();
        kernel().mdls.for_each(|mdl| {
            // SAFETY: an MDL IoAllocateMdl made, in the table, which `for_each` holds: IoFreeMdl cannot free it now.
            let (flags, start, offset, count) = unsafe {
                let m = &*mdl;
                (m.MdlFlags, m.StartVa as usize, m.ByteOffset as usize, m.ByteCount as usize)
            };
            if flags & vhca_ntapi::MDL_PAGES_LOCKED as i16 != 0 && mine(start + offset) {
                out.push((mdl as usize, (offset + count).div_ceil(PAGE_SIZE as usize) as u64));
            }
        });
        out.sort_unstable();
        out
    }
}

impl Drop for UserProcess {
    fn drop(&mut self) {
        let id = self.id();
        crate::lock(&RANGES).retain(|&(process, _, _)| process != id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_probe_reaches_only_the_callers_own_memory() {
        let (a, b) = (0x1000usize, 0x2000usize);
        crate::lock(&RANGES).push((a, 0x7000_0000, 0x7000_2000));
        crate::lock(&RANGES).push((b, 0x7100_0000, 0x7100_1000));
        assert!(!user_probe_allowed(0x7000_0000, 16), "System probing a user process's memory");
        assert!(user_probe_allowed(0x6000_0000, 16), "System's own user memory goes on to the model");
        ATTACHED.with(|c| c.set(a));
        assert!(user_probe_allowed(0x7000_1ff0, 16));
        assert!(!user_probe_allowed(0x7000_1ff0, 32), "past the end of its memory");
        assert!(!user_probe_allowed(0x7100_0000, 16), "another process's memory");
        assert!(!user_probe_allowed(usize::MAX - 4, 16), "a wrapping range");
        ATTACHED.with(|c| c.set(0));
        crate::lock(&RANGES).retain(|&(p, _, _)| p != a && p != b);
    }
}

//! A small hand-assembled PE whose one import call has known driver frames: `outer` calls `inner`, which calls
//! ExAllocatePool2 (or another import of ntoskrnl.exe, `fixture_importing`) through its IAT, each with the unwind
//! info a stack walk reads.

/// `outer` (RVA 0x1000) calls `inner` (0x1020), which calls ExAllocatePool2(NonPaged, 0x100, 'Test') through the
/// IAT; each has a prologue its unwind info describes, and a NOP after its call so the return address is not an
/// epilogue (the unwind codes are what is exercised).
pub const OUTER: u32 = 0x1000;
pub const INNER: u32 = 0x1020;
/// The return addresses: after inner's call of the import, after outer's call of inner.
pub const RETURN_IN_INNER: u32 = 0x103B;
pub const RETURN_IN_OUTER: u32 = 0x1009;

fn put(image: &mut [u8], at: usize, bytes: &[u8]) {
    image[at..at + bytes.len()].copy_from_slice(bytes);
}

fn u16le(v: u16) -> [u8; 2] {
    v.to_le_bytes()
}

fn u32le(v: u32) -> [u8; 4] {
    v.to_le_bytes()
}

/// The PE file: headers (0x200), .text at RVA 0x1000 (file 0x200), .rdata at 0x2000 (file 0x400) holding the
/// import directory, the unwind info and .pdata.
#[allow(dead_code)] // Each test binary that includes this module uses one of the two.
pub fn fixture() -> Vec<u8> {
    fixture_importing("ExAllocatePool2")
}

/// The same PE with `inner` calling `import` instead, with the same register arguments (rcx 0x40, rdx 0x100,
/// r8 'Test'): a lock routine takes 0x40 as its lock's address, which the loader only binds, never reads.
#[allow(dead_code)]
pub fn fixture_importing(import: &str) -> Vec<u8> {
    assert!(import.len() < 0x40, "the hint/name entry has 0x50 bytes at 0x20AE");
    let mut f = vec![0u8; 0x600];
    put(&mut f, 0, b"MZ");
    put(&mut f, 0x3C, &u32le(0x40));
    put(&mut f, 0x40, b"PE\0\0");
    // COFF header: AMD64, 2 sections, PE32+ optional header of 240 bytes, EXECUTABLE_IMAGE | LARGE_ADDRESS_AWARE.
    let coff = 0x44;
    put(&mut f, coff, &u16le(0x8664));
    put(&mut f, coff + 2, &u16le(2));
    put(&mut f, coff + 16, &u16le(240));
    put(&mut f, coff + 18, &u16le(0x22));
    let opt = coff + 20;
    put(&mut f, opt, &u16le(0x20B));
    put(&mut f, opt + 16, &u32le(OUTER)); // AddressOfEntryPoint
    put(&mut f, opt + 24, &0x1_4000_0000u64.to_le_bytes()); // ImageBase
    put(&mut f, opt + 32, &u32le(0x1000)); // SectionAlignment
    put(&mut f, opt + 36, &u32le(0x200)); // FileAlignment
    put(&mut f, opt + 48, &u16le(10)); // MajorSubsystemVersion
    put(&mut f, opt + 56, &u32le(0x3000)); // SizeOfImage
    put(&mut f, opt + 60, &u32le(0x200)); // SizeOfHeaders
    put(&mut f, opt + 68, &u16le(1)); // Subsystem: NATIVE
    put(&mut f, opt + 108, &u32le(16)); // NumberOfRvaAndSizes
    let dirs = opt + 112;
    put(&mut f, dirs + 8, &u32le(0x2000)); // import directory
    put(&mut f, dirs + 12, &u32le(40));
    put(&mut f, dirs + 3 * 8, &u32le(0x2090)); // exception directory (.pdata)
    put(&mut f, dirs + 3 * 8 + 4, &u32le(24));
    let sections = opt + 240;
    for (i, (name, rva, raw, characteristics)) in
        [(b".text\0\0\0", 0x1000u32, 0x200u32, 0x6000_0020u32), (b".rdata\0\0", 0x2000, 0x400, 0x4000_0040)]
            .into_iter()
            .enumerate()
    {
        let s = sections + i * 40;
        put(&mut f, s, name);
        put(&mut f, s + 8, &u32le(0x100)); // VirtualSize
        put(&mut f, s + 12, &u32le(rva));
        put(&mut f, s + 16, &u32le(0x200)); // SizeOfRawData
        put(&mut f, s + 20, &u32le(raw));
        put(&mut f, s + 36, &u32le(characteristics));
    }
    let text = |rva: u32| (rva - 0x1000 + 0x200) as usize;
    // outer: sub rsp,0x28; call inner; nop; add rsp,0x28; ret
    let call_inner = (INNER as i32 - (OUTER as i32 + 9)) as u32;
    let mut outer = vec![0x48, 0x83, 0xEC, 0x28, 0xE8];
    outer.extend(u32le(call_inner));
    outer.extend([0x90, 0x48, 0x83, 0xC4, 0x28, 0xC3]);
    put(&mut f, text(OUTER), &outer);
    // inner: push rbx; sub rsp,0x20; mov ecx,0x40; mov edx,0x100; mov r8d,'Test'; call [rip+IAT]; nop;
    // add rsp,0x20; pop rbx; ret
    let mut inner = vec![0x53, 0x48, 0x83, 0xEC, 0x20, 0xB9, 0x40, 0, 0, 0, 0xBA, 0, 1, 0, 0, 0x41, 0xB8];
    inner.extend(b"Test");
    inner.extend([0xFF, 0x15]);
    inner.extend(u32le(0x2038 - RETURN_IN_INNER));
    inner.extend([0x90, 0x48, 0x83, 0xC4, 0x20, 0x5B, 0xC3]);
    put(&mut f, text(INNER), &inner);
    let rdata = |rva: u32| (rva - 0x2000 + 0x400) as usize;
    // Import descriptor: OriginalFirstThunk 0x2028, Name 0x2060, FirstThunk 0x2038; then a zero descriptor.
    put(&mut f, rdata(0x2000), &u32le(0x2028));
    put(&mut f, rdata(0x200C), &u32le(0x2060));
    put(&mut f, rdata(0x2010), &u32le(0x2038));
    put(&mut f, rdata(0x2028), &0x20AEu64.to_le_bytes()); // lookup table: hint/name at 0x20AE, after .pdata
    put(&mut f, rdata(0x2038), &0x20AEu64.to_le_bytes()); // IAT, the same until bound
    put(&mut f, rdata(0x20B0), import.as_bytes()); // the name, NUL-terminated by the zeroed file
    put(&mut f, rdata(0x2060), b"ntoskrnl.exe\0");
    // UNWIND_INFO, version 1. outer: prolog 4 bytes, one code: at 4, UWOP_ALLOC_SMALL (2) of (4 + 1) * 8 = 0x28.
    put(&mut f, rdata(0x2080), &[0x01, 0x04, 0x01, 0x00, 0x04, 0x42, 0x00, 0x00]);
    // inner: prolog 5 bytes; at 5 UWOP_ALLOC_SMALL 0x20, at 1 UWOP_PUSH_NONVOL (0) RBX (3).
    put(&mut f, rdata(0x2088), &[0x01, 0x05, 0x02, 0x00, 0x05, 0x32, 0x01, 0x30]);
    // .pdata: RUNTIME_FUNCTION (begin, end, unwind info) for each, sorted.
    for (i, (begin, end, info)) in [(OUTER, 0x100F, 0x2080u32), (INNER, 0x1042, 0x2088)].into_iter().enumerate() {
        let at = rdata(0x2090) + i * 12;
        put(&mut f, at, &u32le(begin));
        put(&mut f, at + 4, &u32le(end));
        put(&mut f, at + 8, &u32le(info));
    }
    f
}

//! A small hand-assembled PE with structured exception handling as clang builds it for x86_64-pc-windows-msvc
//! (the same prologs, unwind codes and scope tables as c/probe.c's object): functions that raise through
//! ExRaiseStatus or fault inside __try, a __finally in a callee, a filter that declines, and one with no handler.

/// `guarded(status)`: __try { ExRaiseStatus(status) } __except (EXECUTE_HANDLER) { return code } return 0.
pub const GUARDED: u32 = 0x1000;
/// `outer(status)`: __try { inner(status) } __except (EXECUTE_HANDLER) { return code }; `inner` raises inside a
/// __try/__finally whose handler counts into COUNTER.
pub const OUTER: u32 = 0x1060;
/// `unguarded(status)`: raises with no handler of its own; the return address of its call is UNGUARDED_RETURN.
pub const UNGUARDED: u32 = 0x10A0;
pub const UNGUARDED_RETURN: u32 = 0x10AA;
/// `faulting()`: __try { read [0] } __except (EXECUTE_HANDLER) { return code }.
pub const FAULTING: u32 = 0x10C0;
/// `filtered(status)`: as `guarded`, but its filter answers EXCEPTION_CONTINUE_SEARCH.
pub const FILTERED: u32 = 0x10E0;
/// `continued(status)`: as `guarded`, but its filter answers EXCEPTION_CONTINUE_EXECUTION, which a raised status
/// (noncontinuable) cannot take.
pub const CONTINUED: u32 = 0x1120;
/// The u32 the __finally increments, in .data.
pub const COUNTER: u32 = 0x3000;

const INNER: u32 = 0x1040;
const C_SPECIFIC_HANDLER_THUNK: u32 = 0x1080;
const FINALLY: u32 = 0x1090;
const FILTER_DECLINES: u32 = 0x1100;
const FILTER_CONTINUES: u32 = 0x1108;
const IAT_RAISE: u32 = 0x2040;
const IAT_HANDLER: u32 = 0x2048;

fn put(image: &mut [u8], at: usize, bytes: &[u8]) {
    image[at..at + bytes.len()].copy_from_slice(bytes);
}

fn rel(target: u32, next: u32) -> [u8; 4] {
    (target as i32 - next as i32).to_le_bytes()
}

/// clang's frame for a function with __try: push rbp; sub rsp,0x20; lea rbp,[rsp+0x20] (10 bytes).
const PROLOG: [u8; 10] = [0x55, 0x48, 0x83, 0xEC, 0x20, 0x48, 0x8D, 0x6C, 0x24, 0x20];
/// Its epilogue from `xor eax,eax` on: xor eax,eax; add rsp,0x20; pop rbp; ret; then the __except block at +8,
/// `jmp` back to the add (RAX holds the code there).
const BODY_END: [u8; 10] = [0x31, 0xC0, 0x48, 0x83, 0xC4, 0x20, 0x5D, 0xC3, 0xEB, 0xF8];

/// The UNWIND_INFO clang writes for PROLOG, with __C_specific_handler and a one-scope table.
fn framed_info(scope: [u32; 4]) -> Vec<u8> {
    let mut info = vec![0x19, 0x0A, 0x03, 0x25, 0x0A, 0x03, 0x05, 0x32, 0x01, 0x50, 0x00, 0x00];
    info.extend(C_SPECIFIC_HANDLER_THUNK.to_le_bytes());
    info.extend(1u32.to_le_bytes());
    scope.iter().for_each(|v| info.extend(v.to_le_bytes()));
    info
}

/// `sub rsp,0x28` frames: with a handler and a scope, or none.
fn small_info(scope: Option<[u32; 4]>) -> Vec<u8> {
    let Some(scope) = scope else { return vec![0x01, 0x04, 0x01, 0x00, 0x04, 0x42, 0x00, 0x00] };
    let mut info = vec![0x19, 0x04, 0x01, 0x00, 0x04, 0x42, 0x00, 0x00];
    info.extend(C_SPECIFIC_HANDLER_THUNK.to_le_bytes());
    info.extend(1u32.to_le_bytes());
    scope.iter().for_each(|v| info.extend(v.to_le_bytes()));
    info
}

/// Headers (0x200), .text at RVA 0x1000 (file 0x200), .rdata at 0x2000 (file 0x400: imports, unwind info,
/// .pdata), .data at 0x3000 (file 0x800).
pub fn fixture() -> Vec<u8> {
    let mut f = vec![0u8; 0xA00];
    put(&mut f, 0, b"MZ");
    put(&mut f, 0x3C, &0x40u32.to_le_bytes());
    put(&mut f, 0x40, b"PE\0\0");
    let coff = 0x44;
    put(&mut f, coff, &0x8664u16.to_le_bytes());
    put(&mut f, coff + 2, &3u16.to_le_bytes());
    put(&mut f, coff + 16, &240u16.to_le_bytes());
    put(&mut f, coff + 18, &0x22u16.to_le_bytes());
    let opt = coff + 20;
    put(&mut f, opt, &0x20Bu16.to_le_bytes());
    put(&mut f, opt + 16, &GUARDED.to_le_bytes());
    put(&mut f, opt + 24, &0x1_4000_0000u64.to_le_bytes());
    put(&mut f, opt + 32, &0x1000u32.to_le_bytes());
    put(&mut f, opt + 36, &0x200u32.to_le_bytes());
    put(&mut f, opt + 48, &10u16.to_le_bytes());
    put(&mut f, opt + 56, &0x4000u32.to_le_bytes());
    put(&mut f, opt + 60, &0x200u32.to_le_bytes());
    put(&mut f, opt + 68, &1u16.to_le_bytes());
    put(&mut f, opt + 108, &16u32.to_le_bytes());
    let dirs = opt + 112;
    put(&mut f, dirs + 8, &0x2000u32.to_le_bytes());
    put(&mut f, dirs + 12, &40u32.to_le_bytes());
    put(&mut f, dirs + 24, &0x2240u32.to_le_bytes());
    put(&mut f, dirs + 28, &(7 * 12u32).to_le_bytes());
    let sections = opt + 240;
    for (i, (name, rva, size, raw, characteristics)) in [
        (b".text\0\0\0", 0x1000u32, 0x200u32, 0x200u32, 0x6000_0020u32),
        (b".rdata\0\0", 0x2000, 0x400, 0x400, 0x4000_0040),
        (b".data\0\0\0", 0x3000, 0x200, 0x800, 0xC000_0040),
    ]
    .into_iter()
    .enumerate()
    {
        let s = sections + i * 40;
        put(&mut f, s, name);
        put(&mut f, s + 8, &size.to_le_bytes());
        put(&mut f, s + 12, &rva.to_le_bytes());
        put(&mut f, s + 16, &size.to_le_bytes());
        put(&mut f, s + 20, &raw.to_le_bytes());
        put(&mut f, s + 36, &characteristics.to_le_bytes());
    }
    let text = |rva: u32| (rva - 0x1000 + 0x200) as usize;
    let rdata = |rva: u32| (rva - 0x2000 + 0x400) as usize;

    // A __try'd call of ExRaiseStatus in clang's frame at `at`: PROLOG, call [IAT], BODY_END.
    let framed_call = |f: &mut Vec<u8>, at: u32| {
        let mut code = PROLOG.to_vec();
        code.extend([0xFF, 0x15]);
        code.extend(rel(IAT_RAISE, at + 16));
        code.extend(BODY_END);
        put(f, text(at), &code);
    };
    framed_call(&mut f, GUARDED);
    framed_call(&mut f, FILTERED);
    framed_call(&mut f, CONTINUED);
    // inner: sub rsp,0x28; call [IAT ExRaiseStatus]; nop; add rsp,0x28; ret
    let mut inner = vec![0x48, 0x83, 0xEC, 0x28, 0xFF, 0x15];
    inner.extend(rel(IAT_RAISE, INNER + 10));
    inner.extend([0x90, 0x48, 0x83, 0xC4, 0x28, 0xC3]);
    put(&mut f, text(INNER), &inner);
    // outer: sub rsp,0x28; call inner; nop; xor eax,eax; add rsp,0x28; ret; jmp back to the add (the __except).
    let mut outer = vec![0x48, 0x83, 0xEC, 0x28, 0xE8];
    outer.extend(rel(INNER, OUTER + 9));
    outer.extend([0x90, 0x31, 0xC0, 0x48, 0x83, 0xC4, 0x28, 0xC3, 0xEB, 0xF9]);
    put(&mut f, text(OUTER), &outer);
    // The import thunk the unwind infos name: jmp [IAT __C_specific_handler].
    let mut thunk = vec![0xFF, 0x25];
    thunk.extend(rel(IAT_HANDLER, C_SPECIFIC_HANDLER_THUNK + 6));
    put(&mut f, text(C_SPECIFIC_HANDLER_THUNK), &thunk);
    // The __finally funclet (AbnormalTermination, EstablisherFrame): inc dword [COUNTER]; ret.
    let mut finally = vec![0xFF, 0x05];
    finally.extend(rel(COUNTER, FINALLY + 6));
    finally.push(0xC3);
    put(&mut f, text(FINALLY), &finally);
    // unguarded: sub rsp,0x28; call [IAT ExRaiseStatus]; nop; add rsp,0x28; ret
    let mut unguarded = vec![0x48, 0x83, 0xEC, 0x28, 0xFF, 0x15];
    unguarded.extend(rel(IAT_RAISE, UNGUARDED_RETURN));
    unguarded.extend([0x90, 0x48, 0x83, 0xC4, 0x28, 0xC3]);
    put(&mut f, text(UNGUARDED), &unguarded);
    // faulting: PROLOG; mov eax,[0]; BODY_END.
    let mut faulting = PROLOG.to_vec();
    faulting.extend([0x8B, 0x04, 0x25, 0, 0, 0, 0]);
    faulting.extend(BODY_END);
    put(&mut f, text(FAULTING), &faulting);
    // The filter that declines: xor eax,eax (EXCEPTION_CONTINUE_SEARCH); ret.
    put(&mut f, text(FILTER_DECLINES), &[0x31, 0xC0, 0xC3]);
    // The filter that continues: mov eax,-1 (EXCEPTION_CONTINUE_EXECUTION); ret.
    put(&mut f, text(FILTER_CONTINUES), &[0xB8, 0xFF, 0xFF, 0xFF, 0xFF, 0xC3]);

    // Imports: ExRaiseStatus and __C_specific_handler from ntoskrnl.exe.
    put(&mut f, rdata(0x2000), &0x2028u32.to_le_bytes());
    put(&mut f, rdata(0x200C), &0x20A0u32.to_le_bytes());
    put(&mut f, rdata(0x2010), &IAT_RAISE.to_le_bytes());
    for table in [0x2028, IAT_RAISE] {
        put(&mut f, rdata(table), &0x2070u64.to_le_bytes());
        put(&mut f, rdata(table + 8), &0x2088u64.to_le_bytes());
    }
    put(&mut f, rdata(0x2072), b"ExRaiseStatus\0");
    put(&mut f, rdata(0x208A), b"__C_specific_handler\0");
    put(&mut f, rdata(0x20A0), b"ntoskrnl.exe\0");

    let infos: [(u32, u32, u32, Vec<u8>); 7] = [
        (GUARDED, GUARDED + 0x1A, 0x2100, framed_info([GUARDED + 0xA, GUARDED + 0x11, 1, GUARDED + 0x18])),
        (INNER, INNER + 0x10, 0x2130, small_info(Some([INNER + 4, INNER + 11, FINALLY, 0]))),
        (OUTER, OUTER + 0x13, 0x2160, small_info(Some([OUTER + 4, OUTER + 10, 1, OUTER + 0x11]))),
        (UNGUARDED, UNGUARDED + 0x10, 0x2190, small_info(None)),
        (FAULTING, FAULTING + 0x1B, 0x21D0, framed_info([FAULTING + 0xA, FAULTING + 0x11, 1, FAULTING + 0x19])),
        (
            FILTERED,
            FILTERED + 0x1A,
            0x2200,
            framed_info([FILTERED + 0xA, FILTERED + 0x11, FILTER_DECLINES, FILTERED + 0x18]),
        ),
        (
            CONTINUED,
            CONTINUED + 0x1A,
            0x22A0,
            framed_info([CONTINUED + 0xA, CONTINUED + 0x11, FILTER_CONTINUES, CONTINUED + 0x18]),
        ),
    ];
    for (i, (begin, end, info_rva, info)) in infos.iter().enumerate() {
        put(&mut f, rdata(*info_rva), info);
        let at = rdata(0x2240) + i * 12;
        put(&mut f, at, &begin.to_le_bytes());
        put(&mut f, at + 4, &end.to_le_bytes());
        put(&mut f, at + 8, &info_rva.to_le_bytes());
    }
    f
}

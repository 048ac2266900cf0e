/* vhca.sys's structured exception handling: the kernel routines that report failure by raising an exception
 * (MmProbeAndLockPages) are called inside __try here, and the exception comes back to the Rust driver as a status.
 * Rust has no __try for x86_64-pc-windows-msvc; clang implements it (scope tables for __C_specific_handler in
 * .xdata), so this one unit is C (docs/windows.md). No Windows SDK header: the few declarations are below. */

typedef long NTSTATUS;
typedef struct _MDL MDL;
typedef char KPROCESSOR_MODE;
typedef int LOCK_OPERATION;

/* wdm.h: NTKERNELAPI VOID MmProbeAndLockPages(PMDL, KPROCESSOR_MODE, LOCK_OPERATION); raises
 * STATUS_ACCESS_VIOLATION (or the status the memory manager met) when the pages cannot be made resident. */
__declspec(dllimport) void MmProbeAndLockPages(MDL *mdl, KPROCESSOR_MODE access_mode, LOCK_OPERATION operation);

/* MmProbeAndLockPages, with what it raises returned: STATUS_SUCCESS (0) when the pages are locked, the exception's
 * code otherwise (EXCEPTION_EXECUTE_HANDLER takes every exception the call raises, as Microsoft's samples do). */
NTSTATUS vhca_probe_and_lock_pages(MDL *mdl, KPROCESSOR_MODE access_mode, LOCK_OPERATION operation)
{
    __try {
        MmProbeAndLockPages(mdl, access_mode, operation);
    } __except (1 /* EXCEPTION_EXECUTE_HANDLER */) {
        return _exception_code();
    }
    return 0;
}

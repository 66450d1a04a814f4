/* Built by .ci/windows setup into the Wine 8.0 prefix: without it no Rust .exe starts under Wine 8.0. */
/* Wine 8.0 (Debian 12) has no bcryptprimitives.dll; Rust's std (>= 1.78) imports ProcessPrng
   from it at load time, so every Rust .exe fails to start (status c0000135, exit 53).
   This shim forwards ProcessPrng to RtlGenRandom (advapi32!SystemFunction036). Test use only. */
#include <windows.h>
BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG len);
__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len) {
    while (len) {
        ULONG n = len > 0x10000000 ? 0x10000000 : (ULONG)len;
        if (!SystemFunction036(data, n)) return FALSE;
        data += n;
        len -= n;
    }
    return TRUE;
}

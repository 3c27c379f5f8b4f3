/* Asks the kernel for the AMX permission (x86 arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA) in a
 * constructor, so a process that preloads it may run AMX code from its first instruction on;
 * its children inherit the permission. Harmless where there is no AMX (the call fails).
 *
 * Two uses (docs/vllm.md, "AMX"): `make criu` runs criu with it preloaded, because
 * CRIU 4.2 does not restore the permission and restored processes inherit criu's; `make vllm`
 * builds it for vLLM's CPU build, whose worker can run AMX code before anything asked for the
 * permission (SIGILL at its first step when that step is a short prompt). */
#include <sys/syscall.h>
#include <unistd.h>

__attribute__((constructor)) static void amx_permission(void)
{
    syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */);
}

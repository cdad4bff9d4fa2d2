//! The stub's own code: a position-independent blob copied to [`layout::CODE`] in every stub.
//!
//! Assembly, because after the stub's entry nothing else of the host program is mapped in its
//! address space: no libc, no Rust runtime, no TLS (the FS base is the guest's). It refers to
//! itself only RIP-relatively and to the shared page by its fixed address. Three entry points:
//! - `handler(signo, info, ucontext)`: the SA_SIGINFO handler of every trapped signal, on the
//!   alternate stack. It copies the signal frame's registers, the trap's `siginfo` fields, the FS
//!   base and the address of the frame's XSAVE area to the shared page, hands the turn to the VMM and
//!   serves commands until one says run: then it copies the (possibly changed) registers back into the
//!   frame, restores the FS base and returns through `rt_sigreturn`, which loads them all.
//!   Besides running, the VMM's syscalls and fork, one command applies an `madvise` to a list of
//!   ranges (`CMD_ADVISE`: a clone's pages faulted in ahead, one round trip for the list), and one
//!   makes a list of syscalls (`CMD_BATCH`: a program load's mappings, one round trip for them).
//!   First, though, `answer_rdtsc`: in a replay exec a trapped `rdtsc` (SIGSEGV with SI_KERNEL
//!   at `0f 31`) is a read of the guest's virtual MONOTONIC clock, which the VMM keeps in the
//!   vDSO's data page while the guest runs (`guestos::vdso`). Where the VMM named that page
//!   (`Page::clock_page`, [`super::Stub::set_clock_page`]) and it says replay mode, the handler
//!   answers there, as the VMM would (`guestos::clock::tsc_now`): one quantum added to the
//!   elapsed time if that does not pass the page's limit (as the vDSO's reads: a guest timer
//!   falls due, or another thread's turn comes, only in the VMM), the read recorded as the last
//!   MONOTONIC one and counted in `TSC_READS` (not a scheduler event: `vdso::fold`), `rdx:rax` =
//!   MONOTONIC base + elapsed, `rip` past the instruction; then `rt_sigreturn`. `rdtscp`
//!   (`0f 01 f9`) is answered the same way, with `rcx` (TSC_AUX) 0 as the VMM answers it. A
//!   signal delivered and returned in the stub instead of two context switches: loading
//!   libtorch runs 65,540 `rdtsc` and 65,536 `rdtscp` (libhwy's timer resolution loop: a
//!   `rdtsc` and a `rdtscp` per sample). Anything else (no page, not replay, past the page's
//!   limit) goes on to the VMM. The guest can write the page, so whatever it finds there is only what it itself
//!   sees; the VMM folds the page's count of quanta into its own clocks.
//! - `restorer`: `rt_sigreturn`, the `sa_restorer` of every handler.
//! - `boot`: entered once by a new stub (on the boot stack, with the filter installed): unmaps
//!   everything outside the reserved range (the rest of the VMM's image that the stub was cloned
//!   from) and makes the first trap with a syscall placed *after* `allowed_end`, outside the range
//!   the filter admits. The handler recognises that trap by its address and reports `EXIT_BOOT`.
//!
//! While the VMM has the turn the stub spins `stub_spin` times, calls `sched_yield` `stub_yields`
//! times, then sleeps in `FUTEX_WAIT` for up
//! to a second at a time; after each timeout it polls its socket and exits when the VMM's end is
//! closed (the VMM died).

use std::mem::offset_of;

use super::layout;
use super::shared::{self, Page};
use crate::guestos::vdso;

std::arch::global_asm!(
    ".pushsection .text.collimate_systrap_blob,\"ax\",@progbits",
    ".p2align 12",
    ".globl collimate_systrap_blob_start",
    ".hidden collimate_systrap_blob_start",
    "collimate_systrap_blob_start:",
    // ---- handler(rdi = signo, rsi = siginfo, rdx = ucontext) ----
    "collimate_systrap_handler:",
    // A trapped `rdtsc` (SIGSEGV, SI_KERNEL, 0f 31 at the guest's rip) in replay mode, with a
    // clock page to read: answered here, without the VMM (see `answer_rdtsc` below).
    "cmp edi, 11",
    "jne 60f",
    "cmp dword ptr [rsi + 8], 0x80",
    "jne 60f",
    "movabs r8, {shared}",
    "mov r9, qword ptr [r8 + {clock_page}]",
    "test r9, r9",
    "jz 60f",
    "mov r10, qword ptr [rdx + {uc_gregs} + 16 * 8]",
    "xor r11d, r11d", // 0: rdtsc (0f 31), 1: rdtscp (0f 01 f9)
    "cmp word ptr [r10], 0x310f",
    "je 61f",
    "cmp word ptr [r10], 0x010f",
    "jne 60f",
    "cmp byte ptr [r10 + 2], 0xf9",
    "jne 60f",
    "mov r11d, 1",
    "61:",
    "cmp qword ptr [r9 + {ck_mode}], {ck_replay}",
    "jne 60f",
    "mov rax, qword ptr [r9 + {ck_quantum}]",
    "add rax, qword ptr [r9 + {ck_elapsed}]",
    "cmp rax, qword ptr [r9 + {ck_limit}]",
    "ja 60f",
    "mov qword ptr [r9 + {ck_elapsed}], rax",
    "mov qword ptr [r9 + {ck_last_mono}], rax",
    "add qword ptr [r9 + {ck_tsc_reads}], 1",
    "add rax, qword ptr [r9 + {ck_mono_base}]",
    "mov ecx, eax",
    "mov qword ptr [rdx + {uc_gregs} + 13 * 8], rcx",
    "shr rax, 32",
    "mov qword ptr [rdx + {uc_gregs} + 12 * 8], rax",
    "add qword ptr [rdx + {uc_gregs} + 16 * 8], 2",
    "test r11d, r11d",
    "jz 62f",
    // rdtscp: also rcx = TSC_AUX, 0 (CPU 0, as the VMM answers), and one byte longer.
    "mov qword ptr [rdx + {uc_gregs} + 14 * 8], 0",
    "add qword ptr [rdx + {uc_gregs} + 16 * 8], 1",
    "62:",
    "ret",
    "60:",
    "sub rsp, 40",
    "mov r14, rsi",
    "mov r13, rdx",
    "movabs r12, {shared}",
    // Interrupted in the blob's own code outside a handler (a patched site's entry or return,
    // below): in the return's window the guest's registers are the page's, so the trap is the
    // guest's there; anywhere else only the VMM's kick can arrive, and is kept for the return.
    "mov r10, qword ptr [r13 + {uc_gregs} + 16 * 8]",
    "lea r11, [rip + collimate_systrap_blob_start]",
    "cmp r10, r11",
    "jb 67f",
    "lea r11, [rip + collimate_systrap_blob_end]",
    "cmp r10, r11",
    "jae 67f",
    "lea r11, [rip + collimate_systrap_resume]",
    "cmp r10, r11",
    "jb 66f",
    "lea r11, [rip + collimate_systrap_resume_end]",
    "cmp r10, r11",
    "jae 66f",
    "lea rsi, [r12 + {gregs}]",
    "lea rdi, [r13 + {uc_gregs}]",
    "mov ecx, 18",
    "rep movsq",
    "jmp 67f",
    "66:",
    "cmp dword ptr [r14], {kick}",
    "jne 67f",
    "mov dword ptr [r12 + {kick_pending}], 1",
    "add rsp, 40",
    "ret",
    "67:",
    "lea rsi, [r13 + {uc_gregs}]",
    "lea rdi, [r12 + {gregs}]",
    "mov ecx, 23",
    "rep movsq",
    "mov eax, dword ptr [r14]",
    "mov dword ptr [r12 + {signo}], eax",
    "mov eax, dword ptr [r14 + 8]",
    "mov dword ptr [r12 + {code}], eax",
    "mov rax, qword ptr [r14 + 16]",
    "mov qword ptr [r12 + {addr}], rax",
    "mov rax, qword ptr [r14 + 24]", // si_syscall, then si_arch in the high half
    "mov qword ptr [r12 + {sysnr}], rax",
    "mov rax, qword ptr [r13 + {uc_fpregs}]",
    "mov qword ptr [r12 + {fpstate}], rax",
    "test dword ptr [r12 + {flags}], {flag_fsgsbase}",
    "jz 2f",
    "rdfsbase rax",
    "mov qword ptr [r12 + {fs_base}], rax",
    "jmp 3f",
    "2:",
    "mov eax, 158", // arch_prctl(ARCH_GET_FS, &fs_base)
    "mov edi, 0x1003",
    "lea rsi, [r12 + {fs_base}]",
    "syscall",
    "3:",
    "mov eax, {exit_event}",
    "lea rcx, [rip + collimate_systrap_boot_trap_end]",
    "cmp rcx, qword ptr [r13 + {uc_gregs} + 16 * 8]",
    "jne 4f",
    "mov eax, {exit_boot}",
    "4:",
    "mov dword ptr [r12 + {exit}], eax",
    // an exit of the guest: the clock page's words into the shared page, if the VMM named the
    // page (it is then mapped and readable, as for `answer_rdtsc`)
    "19:",
    "mov rsi, qword ptr [r12 + {clock_page}]",
    "test rsi, rsi",
    "jz 20f",
    "cld",
    "lea rdi, [r12 + {clock_copy}]",
    "mov ecx, {clock_words}",
    "rep movsq",
    // hand the turn to the VMM; wake it only if it sleeps
    "20:",
    "mov eax, {vmm_turn}",
    "xchg dword ptr [r12 + {state}], eax",
    "cmp dword ptr [r12 + {vmm_sleeping}], 0",
    "je 21f",
    "mov eax, 202", // futex(&state, FUTEX_WAKE, 1)
    "lea rdi, [r12 + {state}]",
    "mov esi, 1",
    "mov edx, 1",
    "syscall",
    // wait for the stub's turn: spin, then sleep
    "21:",
    "mov ecx, dword ptr [r12 + {stub_spin}]",
    "22:",
    "cmp dword ptr [r12 + {state}], {stub_turn}",
    "je 30f",
    "test ecx, ecx",
    "jz 26f",
    "pause",
    "dec ecx",
    "jmp 22b",
    // then yield the CPU up to stub_yields times, checking after each
    "26:",
    "mov dword ptr [r12 + {stub_missed}], 1", // the spin was not answered (adaptive hand-off)
    "mov r15d, dword ptr [r12 + {stub_yields}]",
    "27:",
    "test r15d, r15d",
    "jz 23f",
    "mov eax, 24", // sched_yield()
    "syscall",
    "dec r15d",
    "cmp dword ptr [r12 + {state}], {stub_turn}",
    "je 30f",
    "jmp 27b",
    "23:",
    "mov eax, 1",
    "xchg dword ptr [r12 + {stub_sleeping}], eax",
    "cmp dword ptr [r12 + {state}], {stub_turn}",
    "je 25f",
    "mov qword ptr [rsp + 8], 1", // timeout: 1 s
    "mov qword ptr [rsp + 16], 0",
    "mov eax, 202", // futex(&state, FUTEX_WAIT, VMM_TURN, &timeout)
    "lea rdi, [r12 + {state}]",
    "xor esi, esi",
    "mov edx, {vmm_turn}",
    "lea r10, [rsp + 8]",
    "syscall",
    "cmp rax, -110", // ETIMEDOUT: is the VMM still there?
    "jne 25f",
    "mov dword ptr [rsp], {sock_fd}", // ppoll({sock, 0}, 1, &{0, 0}, NULL, 8)
    "mov dword ptr [rsp + 4], 0",
    "mov qword ptr [rsp + 8], 0",
    "mov qword ptr [rsp + 16], 0",
    "mov eax, 271",
    "mov rdi, rsp",
    "mov esi, 1",
    "lea rdx, [rsp + 8]",
    "xor r10d, r10d",
    "mov r8d, 8",
    "syscall",
    "test word ptr [rsp + 6], 0x18", // POLLERR | POLLHUP
    "jz 23b",
    "mov eax, 231", // exit_group(1): the VMM is gone
    "mov edi, 1",
    "syscall",
    "25:",
    "mov dword ptr [r12 + {stub_sleeping}], 0",
    "cmp dword ptr [r12 + {state}], {stub_turn}",
    "jne 23b",
    // a command
    "30:",
    "mov rax, qword ptr [r12 + {cmd}]",
    "cmp rax, {cmd_run}",
    "je 40f",
    "cmp rax, {cmd_syscall}",
    "je 31f",
    "cmp rax, {cmd_fork}",
    "je 50f",
    "cmp rax, {cmd_advise}",
    "je 60f",
    "cmp rax, {cmd_batch}",
    "je 70f",
    "mov qword ptr [r12 + {ret}], -22",
    "jmp 32f",
    "31:",
    "mov rax, qword ptr [r12 + {args}]",
    "mov rdi, qword ptr [r12 + {args} + 8]",
    "mov rsi, qword ptr [r12 + {args} + 16]",
    "mov rdx, qword ptr [r12 + {args} + 24]",
    "mov r10, qword ptr [r12 + {args} + 32]",
    "mov r8, qword ptr [r12 + {args} + 40]",
    "mov r9, qword ptr [r12 + {args} + 48]",
    "syscall",
    "mov qword ptr [r12 + {ret}], rax",
    "32:",
    "mov dword ptr [r12 + {exit}], {exit_done}",
    "jmp 20b",
    // run: registers back into the frame, FS base, return through rt_sigreturn
    "40:",
    "cmp dword ptr [r12 + {kick_pending}], 0",
    "jne 85f",
    "test r13, r13",
    "jz 80f",
    "lea rsi, [r12 + {gregs}]",
    "lea rdi, [r13 + {uc_gregs}]",
    "mov ecx, 18",
    "rep movsq",
    "test dword ptr [r12 + {flags}], {flag_fsgsbase}",
    "jz 41f",
    "mov rax, qword ptr [r12 + {fs_base}]",
    "wrfsbase rax",
    "jmp 42f",
    "41:",
    "mov eax, 158", // arch_prctl(ARCH_SET_FS, fs_base)
    "mov edi, 0x1002",
    "mov rsi, qword ptr [r12 + {fs_base}]",
    "syscall",
    "42:",
    "add rsp, 40",
    "ret",
    // fork
    "50:",
    "mov rbx, qword ptr [r12 + {args}]",
    "mov rbp, qword ptr [r12 + {args} + 8]",
    "mov rsi, qword ptr [r12 + {args} + 16]",
    "test rsi, rsi",
    "jz 56f",
    "mov eax, 47", // recvmsg(sock, args[2], 0): the two fds arrive here, not in a command before
    "mov edi, {sock_fd}",
    "xor edx, edx",
    "syscall",
    "test rax, rax",
    "js 57f",
    "movsxd rbx, dword ptr [r12 + {batch_fds}]",
    "movsxd rbp, dword ptr [r12 + {batch_fds} + 4]",
    "56:",
    "mov eax, 56", // clone(SIGCHLD, 0, 0, 0, 0): a plain fork
    "mov edi, 17",
    "xor esi, esi",
    "xor edx, edx",
    "xor r10d, r10d",
    "xor r8d, r8d",
    "syscall",
    "test rax, rax",
    "jnz 52f",
    // the child: its own shared page and socket
    "mov eax, 9", // mmap(SHARED, len, RW, MAP_SHARED | MAP_FIXED, memfd, 0)
    "mov rdi, r12",
    "mov esi, {shared_len}",
    "mov edx, 3",
    "mov r10d, 0x11",
    "mov r8, rbx",
    "xor r9d, r9d",
    "syscall",
    "cmp rax, r12",
    "jne 51f",
    "mov eax, 33", // dup2(sock, SOCK_FD)
    "mov rdi, rbp",
    "mov esi, {sock_fd}",
    "syscall",
    "test rax, rax",
    "js 51f",
    "mov eax, 3",
    "mov rdi, rbx",
    "syscall",
    "mov eax, 3",
    "mov rdi, rbp",
    "syscall",
    "mov qword ptr [r12 + {ret}], 0",
    "jmp 32b",
    "51:",
    "mov eax, 231", // exit_group(2): the child could not take its own page
    "mov edi, 2",
    "syscall",
    "52:",
    "mov r15, rax",
    "mov eax, 3",
    "mov rdi, rbx",
    "syscall",
    "mov eax, 3",
    "mov rdi, rbp",
    "syscall",
    "mov qword ptr [r12 + {ret}], r15",
    "jmp 32b",
    "57:",
    "mov qword ptr [r12 + {ret}], rax", // the recvmsg failed: no fork
    "jmp 32b",
    // madvise(start, len, args[0]) for each of the args[1] (start, len) pairs in the scratch
    // area; ret = how many succeeded
    "60:",
    "lea rbx, [r12 + {scratch}]",
    "mov rbp, qword ptr [r12 + {args} + 8]",
    "xor r15d, r15d",
    "61:",
    "test rbp, rbp",
    "jz 63f",
    "mov eax, 28",
    "mov rdi, qword ptr [rbx]",
    "mov rsi, qword ptr [rbx + 8]",
    "mov rdx, qword ptr [r12 + {args}]",
    "syscall",
    "test rax, rax",
    "jnz 62f",
    "inc r15",
    "62:",
    "add rbx, 16",
    "dec rbp",
    "jmp 61b",
    "63:",
    "mov qword ptr [r12 + {ret}], r15",
    "jmp 32b",
    // args[1] syscalls, each (nr, a0..a5) at batch_at, one after the other; each one's result
    // goes over its nr; stop after the first that fails; ret = how many ran. An a0 or a4 of
    // FD_RECEIVED_0/1 is the first/second fd at batch_fds (what a recvmsg entry received).
    "70:",
    "lea rbx, [r12 + {batch_at}]",
    "mov rbp, qword ptr [r12 + {args} + 8]",
    "xor r15d, r15d",
    "71:",
    "test rbp, rbp",
    "jz 73f",
    "movsxd rcx, dword ptr [r12 + {batch_fds}]",
    "movsxd r11, dword ptr [r12 + {batch_fds} + 4]",
    "mov rdi, qword ptr [rbx + 8]",
    "cmp rdi, {fd_received_0}",
    "cmove rdi, rcx",
    "cmp rdi, {fd_received_1}",
    "cmove rdi, r11",
    "mov r8, qword ptr [rbx + 40]",
    "cmp r8, {fd_received_0}",
    "cmove r8, rcx",
    "cmp r8, {fd_received_1}",
    "cmove r8, r11",
    "mov rax, qword ptr [rbx]",
    "mov rsi, qword ptr [rbx + 16]",
    "mov rdx, qword ptr [rbx + 24]",
    "mov r10, qword ptr [rbx + 32]",
    "mov r9, qword ptr [rbx + 48]",
    "syscall",
    "mov qword ptr [rbx], rax",
    "inc r15",
    "cmp rax, -4095",
    "jae 73f",
    "add rbx, 56",
    "dec rbp",
    "jmp 71b",
    "73:",
    "mov qword ptr [r12 + {ret}], r15",
    "jmp 32b",
    // ---- syscall_entry: a patched site's trampoline (`patch.rs`) jumps here with rax = the
    // syscall number and rcx = the address after the site's `syscall` (what that instruction
    // would leave in rcx); every other register is the guest's. It reports what the SIGSYS of
    // that `syscall` would (the registers with r11 = rflags, si_syscall, si_call_addr), the
    // XSAVE area saved at XSAVE_BUF, and serves the VMM as the handler does; then returns to
    // the guest without a signal frame ("80:"). ----
    ".globl collimate_systrap_syscall_entry",
    ".hidden collimate_systrap_syscall_entry",
    "collimate_systrap_syscall_entry:",
    "movabs qword ptr [{shared_rax}], rax",
    "movabs rax, {shared}",
    "mov qword ptr [rax + {gregs} + 15 * 8], rsp",
    "movabs rsp, {entry_stack}",
    "pushfq",
    "pop r11",
    "mov qword ptr [rax + {gregs}], r8",
    "mov qword ptr [rax + {gregs} + 8], r9",
    "mov qword ptr [rax + {gregs} + 16], r10",
    "mov qword ptr [rax + {gregs} + 24], r11",
    "mov qword ptr [rax + {gregs} + 32], r12",
    "mov qword ptr [rax + {gregs} + 40], r13",
    "mov qword ptr [rax + {gregs} + 48], r14",
    "mov qword ptr [rax + {gregs} + 56], r15",
    "mov qword ptr [rax + {gregs} + 64], rdi",
    "mov qword ptr [rax + {gregs} + 72], rsi",
    "mov qword ptr [rax + {gregs} + 80], rbp",
    "mov qword ptr [rax + {gregs} + 88], rbx",
    "mov qword ptr [rax + {gregs} + 96], rdx",
    "mov qword ptr [rax + {gregs} + 14 * 8], rcx",
    "mov qword ptr [rax + {gregs} + 16 * 8], rcx",
    "mov qword ptr [rax + {gregs} + 17 * 8], r11",
    "mov qword ptr [rax + {gregs} + 19 * 8], 0", // ERR
    "mov qword ptr [rax + {gregs} + 20 * 8], 0", // TRAPNO
    "mov qword ptr [rax + {addr}], rcx",
    "mov r12, rax",
    "mov dword ptr [r12 + {signo}], 31", // SIGSYS
    "mov dword ptr [r12 + {code}], 1",   // SYS_SECCOMP
    "mov eax, dword ptr [r12 + {gregs} + 13 * 8]",
    "movabs rcx, {audit_arch}",
    "or rax, rcx",
    "mov qword ptr [r12 + {sysnr}], rax",
    "add qword ptr [r12 + {patched_entries}], 1",
    "mov eax, dword ptr [r12 + {xsave_mask}]",
    "mov edx, dword ptr [r12 + {xsave_mask} + 4]",
    "movabs rcx, {xsave_buf}",
    "xsave [rcx]",
    "mov qword ptr [r12 + {fpstate}], rcx",
    "mov dword ptr [r12 + {xsave_dirty}], 0",
    "xor r13d, r13d", // no signal frame: "40:" returns through "80:"
    "sub rsp, 40",
    "test dword ptr [r12 + {flags}], {flag_fsgsbase}",
    "jz 81f",
    "rdfsbase rax",
    "mov qword ptr [r12 + {fs_base}], rax",
    "jmp 82f",
    "81:",
    "mov eax, 158", // arch_prctl(ARCH_GET_FS, &fs_base)
    "mov edi, 0x1003",
    "lea rsi, [r12 + {fs_base}]",
    "syscall",
    "82:",
    "mov dword ptr [r12 + {exit}], {exit_event}",
    "jmp 19b",
    // a kick kept while the stub ran its own code: report it at the registers to run
    "85:",
    "mov dword ptr [r12 + {kick_pending}], 0",
    "mov dword ptr [r12 + {signo}], {kick}",
    "mov dword ptr [r12 + {code}], 0", // SI_USER
    "mov dword ptr [r12 + {exit}], {exit_event}",
    "jmp 19b",
    // run after a patched entry: the XSAVE area if the VMM replaced it, the FS base, then the
    // registers; `jmp rcx` when the VMM left rip = rcx (a syscall's return), else rt_sigreturn
    // through a frame built here
    "80:",
    "cmp dword ptr [r12 + {xsave_dirty}], 0",
    "je 86f",
    "mov eax, dword ptr [r12 + {xsave_mask}]",
    "mov edx, dword ptr [r12 + {xsave_mask} + 4]",
    "movabs rcx, {xsave_buf}",
    "xrstor [rcx]",
    "mov dword ptr [r12 + {xsave_dirty}], 0",
    "86:",
    "test dword ptr [r12 + {flags}], {flag_fsgsbase}",
    "jz 87f",
    "mov rax, qword ptr [r12 + {fs_base}]",
    "wrfsbase rax",
    "jmp 88f",
    "87:",
    "mov eax, 158", // arch_prctl(ARCH_SET_FS, fs_base)
    "mov edi, 0x1002",
    "mov rsi, qword ptr [r12 + {fs_base}]",
    "syscall",
    "88:",
    // From here to resume_end a signal finds the guest's registers in the page (the handler
    // takes them as the interrupted ones); before it, a kick is kept, and checked first here.
    ".globl collimate_systrap_resume",
    ".hidden collimate_systrap_resume",
    "collimate_systrap_resume:",
    "cmp dword ptr [r12 + {kick_pending}], 0",
    "jne 85b",
    "mov rax, qword ptr [r12 + {gregs} + 16 * 8]",
    "cmp rax, qword ptr [r12 + {gregs} + 14 * 8]",
    "jne 89f",
    "push qword ptr [r12 + {gregs} + 17 * 8]",
    "popfq",
    "mov r8, qword ptr [r12 + {gregs}]",
    "mov r9, qword ptr [r12 + {gregs} + 8]",
    "mov r10, qword ptr [r12 + {gregs} + 16]",
    "mov r11, qword ptr [r12 + {gregs} + 24]",
    "mov r13, qword ptr [r12 + {gregs} + 40]",
    "mov r14, qword ptr [r12 + {gregs} + 48]",
    "mov r15, qword ptr [r12 + {gregs} + 56]",
    "mov rdi, qword ptr [r12 + {gregs} + 64]",
    "mov rsi, qword ptr [r12 + {gregs} + 72]",
    "mov rbp, qword ptr [r12 + {gregs} + 80]",
    "mov rbx, qword ptr [r12 + {gregs} + 88]",
    "mov rdx, qword ptr [r12 + {gregs} + 96]",
    "mov rax, qword ptr [r12 + {gregs} + 13 * 8]",
    "mov rcx, qword ptr [r12 + {gregs} + 16 * 8]",
    "mov rsp, qword ptr [r12 + {gregs} + 15 * 8]",
    "mov r12, qword ptr [r12 + {gregs} + 32]",
    "jmp rcx",
    // an rt_sigframe's ucontext at rsp (rt_sigreturn reads it there): flags, the alternate stack
    // (restored by the call), the registers, the XSAVE area, an empty signal mask
    "89:",
    "movabs rsp, {entry_stack}",
    "sub rsp, {uc_size}",
    "mov qword ptr [rsp], 7", // UC_FP_XSTATE | UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS
    "mov qword ptr [rsp + 8], 0",
    "movabs rax, {alt_stack}",
    "mov qword ptr [rsp + 16], rax",
    "mov qword ptr [rsp + 24], 0",
    "mov qword ptr [rsp + 32], {alt_stack_len}",
    "lea rsi, [r12 + {gregs}]",
    "lea rdi, [rsp + {uc_gregs}]",
    "mov ecx, 18",
    "rep movsq",
    "movabs rax, {user_segments}",
    "mov qword ptr [rsp + {uc_gregs} + 18 * 8], rax",
    "lea rdi, [rsp + {uc_gregs} + 19 * 8]",
    "xor eax, eax",
    "mov ecx, 4",
    "rep stosq", // ERR, TRAPNO, OLDMASK, CR2
    "movabs rax, {xsave_buf}",
    "mov qword ptr [rsp + {uc_fpregs}], rax",
    "mov qword ptr [rsp + {uc_sigmask}], 0",
    "mov eax, 15",
    "syscall",
    ".globl collimate_systrap_resume_end",
    ".hidden collimate_systrap_resume_end",
    "collimate_systrap_resume_end:",
    "ud2",
    // ---- restorer ----
    ".globl collimate_systrap_restorer",
    ".hidden collimate_systrap_restorer",
    "collimate_systrap_restorer:",
    "mov eax, 15",
    "syscall",
    "ud2",
    // ---- boot: rsp is the boot stack ----
    ".globl collimate_systrap_boot",
    ".hidden collimate_systrap_boot",
    "collimate_systrap_boot:",
    "mov eax, 11", // munmap(0, STUB_BASE)
    "xor edi, edi",
    "movabs rsi, {stub_base}",
    "syscall",
    "mov eax, 11", // munmap(STUB_END, TASK_SIZE - STUB_END)
    "movabs rdi, {stub_end}",
    "movabs rsi, {above_len}",
    "syscall",
    ".globl collimate_systrap_allowed_end",
    ".hidden collimate_systrap_allowed_end",
    "collimate_systrap_allowed_end:",
    "syscall", // the first trap: outside the admitted range
    ".globl collimate_systrap_boot_trap_end",
    ".hidden collimate_systrap_boot_trap_end",
    "collimate_systrap_boot_trap_end:",
    "ud2",
    ".globl collimate_systrap_blob_end",
    ".hidden collimate_systrap_blob_end",
    "collimate_systrap_blob_end:",
    ".popsection",
    shared = const layout::SHARED,
    shared_len = const layout::SHARED_LEN,
    stub_base = const layout::STUB_BASE,
    stub_end = const layout::STUB_END,
    above_len = const layout::TASK_SIZE - layout::STUB_END,
    sock_fd = const layout::SOCK_FD,
    uc_gregs = const UC_GREGS,
    uc_fpregs = const UC_FPREGS,
    state = const offset_of!(Page, state),
    stub_sleeping = const offset_of!(Page, stub_sleeping),
    vmm_sleeping = const offset_of!(Page, vmm_sleeping),
    stub_spin = const offset_of!(Page, stub_spin),
    stub_yields = const offset_of!(Page, stub_yields),
    stub_missed = const offset_of!(Page, stub_missed),
    flags = const offset_of!(Page, flags),
    exit = const offset_of!(Page, exit),
    signo = const offset_of!(Page, signo),
    code = const offset_of!(Page, code),
    addr = const offset_of!(Page, addr),
    sysnr = const offset_of!(Page, sysnr),
    fpstate = const offset_of!(Page, fpstate),
    fs_base = const offset_of!(Page, fs_base),
    gregs = const offset_of!(Page, gregs),
    cmd = const offset_of!(Page, cmd),
    args = const offset_of!(Page, args),
    ret = const offset_of!(Page, ret),
    flag_fsgsbase = const shared::FLAG_FSGSBASE,
    clock_page = const offset_of!(Page, clock_page),
    clock_copy = const offset_of!(Page, clock_copy),
    clock_words = const vdso::WORDS,
    ck_mode = const vdso::MODE * 8,
    ck_replay = const vdso::MODE_REPLAY,
    ck_mono_base = const vdso::MONO_BASE * 8,
    ck_elapsed = const vdso::ELAPSED * 8,
    ck_quantum = const vdso::QUANTUM * 8,
    ck_last_mono = const vdso::LAST_MONO * 8,
    ck_limit = const vdso::LIMIT * 8,
    ck_tsc_reads = const vdso::TSC_READS * 8,
    exit_event = const shared::EXIT_EVENT,
    exit_boot = const shared::EXIT_BOOT,
    exit_done = const shared::EXIT_DONE,
    vmm_turn = const shared::VMM_TURN,
    stub_turn = const shared::STUB_TURN,
    cmd_run = const shared::CMD_RUN,
    cmd_syscall = const shared::CMD_SYSCALL,
    cmd_fork = const shared::CMD_FORK,
    cmd_advise = const shared::CMD_ADVISE,
    cmd_batch = const shared::CMD_BATCH,
    batch_at = const shared::BATCH_AT,
    batch_fds = const shared::BATCH_FDS,
    fd_received_0 = const shared::FD_RECEIVED[0],
    fd_received_1 = const shared::FD_RECEIVED[1],
    scratch = const shared::SCRATCH,
    entry_stack = const layout::BOOT_STACK + layout::BOOT_STACK_LEN,
    shared_rax = const layout::SHARED + offset_of!(Page, gregs) as u64 + 13 * 8,
    kick = const super::preempt::KICK_SIGNAL,
    kick_pending = const offset_of!(Page, kick_pending),
    xsave_dirty = const offset_of!(Page, xsave_dirty),
    xsave_mask = const offset_of!(Page, xsave_mask),
    patched_entries = const offset_of!(Page, patched_entries),
    xsave_buf = const layout::XSAVE_BUF,
    alt_stack = const layout::ALT_STACK,
    alt_stack_len = const layout::ALT_STACK_LEN,
    audit_arch = const 0xc000_003e_u64 << 32,
    uc_size = const UC_SIGMASK + 128,
    uc_sigmask = const UC_SIGMASK,
    user_segments = const 0x33_u64 | (0x2b_u64 << 48),
);

/// Offset of `uc_mcontext.gregs` in Linux's x86-64 `ucontext_t`.
const UC_GREGS: usize = 40;
/// Offset of `uc_mcontext.fpregs` (the pointer to the XSAVE area).
const UC_FPREGS: usize = UC_GREGS + 23 * 8;
/// Offset of `uc_sigmask` (after the fpregs pointer and 8 reserved words).
const UC_SIGMASK: usize = UC_FPREGS + 8 + 8 * 8;

extern "C" {
    static collimate_systrap_blob_start: u8;
    static collimate_systrap_restorer: u8;
    static collimate_systrap_boot: u8;
    static collimate_systrap_syscall_entry: u8;
    static collimate_systrap_allowed_end: u8;
    static collimate_systrap_blob_end: u8;
}

/// The blob's bytes, to copy to [`layout::CODE`].
pub fn code() -> &'static [u8] {
    let start = &raw const collimate_systrap_blob_start;
    let end = &raw const collimate_systrap_blob_end;
    let len = end as usize - start as usize;
    assert!(len as u64 <= layout::CODE_LEN, "the systrap blob outgrew its code area");
    // SAFETY: the two symbols bracket the blob in this binary's read-only text, which lives as long
    // as the program.
    unsafe { std::slice::from_raw_parts(start, len) }
}

fn offset(sym: *const u8) -> u64 {
    sym as u64 - (&raw const collimate_systrap_blob_start) as u64
}

/// Where the copied blob's signal handler is.
pub fn handler() -> u64 {
    layout::CODE // the handler is the blob's first instruction
}

/// Where the copied blob's `sa_restorer` is.
pub fn restorer() -> u64 {
    layout::CODE + offset(&raw const collimate_systrap_restorer)
}

/// Where a patched syscall site's trampoline enters the blob.
pub fn syscall_entry() -> u64 {
    layout::CODE + offset(&raw const collimate_systrap_syscall_entry)
}

/// Where a new stub enters the blob.
pub fn boot() -> u64 {
    layout::CODE + offset(&raw const collimate_systrap_boot)
}

/// The last address a syscall from the blob may return to and still be admitted by the filter (the
/// boot trap's syscall lies after it).
pub fn allowed_end() -> u64 {
    layout::CODE + offset(&raw const collimate_systrap_allowed_end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blob_fits_and_entries_are_inside() {
        let len = code().len() as u64;
        assert!(len > 0 && len <= layout::CODE_LEN);
        for a in [handler(), restorer(), boot(), allowed_end()] {
            assert!(a >= layout::CODE && a < layout::CODE + len);
        }
        assert!(boot() < allowed_end());
    }
}

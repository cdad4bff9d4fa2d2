/*
 * testvm.S - mailbox-driven guest test program for collimate_core.
 *
 * Runs in x86-64 ring 3 with no kernel; the engine services `syscall`
 * (see docs/engine-api.md).  No libc, no stack usage except one
 * pushfq/pop pair in LOADREGS (so rsp is preserved exactly).
 *
 * Build (see build.sh):
 *   gcc -nostdlib -static -no-pie -Wl,--build-id=none \
 *       -Wl,-Ttext=0x400000 -Wl,-Tdata=0x600000 -Wl,-Tbss=0x1000000 \
 *       -o testvm testvm.S
 *
 * FIXED guest-virtual addresses (build.sh checks them with nm):
 *   0x0000000000400000  .text (_start is the first instruction)
 *   0x0000000000600000  mailbox   (.data, 5 x u64: cmd, arg0, arg1, arg2, result)
 *   0x0000000000601000  regs_in   (.data, 4 KiB)
 *   0x0000000000602000  regs_out  (.data, 4 KiB)
 *   0x0000000001000000  heap      (.bss, 128 MiB = 32768 pages of 4 KiB)
 *
 * regs_in / regs_out layout (byte offsets):
 *   0..120   rax, rbx, rcx, rdx, rsi, rdi, rbp, r8, r9, r10, r11, r12,
 *            r13, r14, r15  (u64 each; rsp is NOT loaded)
 *   120      regs_out only: rsp at the time of the store (informational)
 *   128      regs_out only: rflags at the time of the store (informational)
 *   256..768 ymm0..ymm15, 32 bytes each (vmovdqu)
 *
 * Protocol: on start the guest yields 0 ("ready").  Then forever:
 *   read mailbox.cmd, execute it, write mailbox.result, yield(cmd).
 * The guest never clears the mailbox: running again without rewriting it
 * repeats the same command.
 *
 * Commands (result is written as u64; -1 = 0xffff_ffff_ffff_ffff):
 *   1  FILL      heap[(arg2+i)*4096] = (u8)arg1 for i in 0..arg0; result = arg0
 *   2  SUM       result = sum of heap[(arg2+i)*4096] (u8) for i in 0..arg0
 *   3  SPIN      `jmp .` forever (never yields)
 *   4  LOADREGS  load GPRs + ymm0..15 from regs_in, `out 0xE0, al`,
 *                store them to regs_out, result = 4, yield(4)
 *   5  WRITE     result = write(1, heap + arg2*4096, arg0)
 *   6  WRITE_ERR result = write(2, heap + arg2*4096, arg0)
 *   7  FAULT     arg0: 0 ud2 (#UD 6), 1 store to address 0 (#PF 14, cr2=0),
 *                2 jmp 0xffffff8000000000 (#PF 14 or ring-0 page),
 *                3 int3 (#BP 3), 4 div by zero (#DE 0); other arg0: result=-1
 *   8  EXIT      exit_group(arg0)  (never yields)
 *   9  SYSCALL   result = syscall(nr=arg0, rdi=arg1, rsi=arg2, rdx=r10=r8=r9=0)
 *                (unknown nr -> -ENOSYS = -38; 39 getpid -> 1)
 *   10 HELLO     result = write(1, "hello from the guest\n", 21)
 *   other        result = -1
 * FILL/SUM/WRITE/WRITE_ERR with a range outside the heap: no-op, result = -1.
 *
 * Requires: IOPL=3 (for `out`), CR4.OSXSAVE=1 and XCR0 = 7 (x87|SSE|AVX) for
 * the ymm accesses in LOADREGS.
 */

        .intel_syntax noprefix

        .set MAILBOX_CMD,    0
        .set MAILBOX_ARG0,   8
        .set MAILBOX_ARG1,   16
        .set MAILBOX_ARG2,   24
        .set MAILBOX_RESULT, 32

        .set HEAP_PAGES,     32768            /* 128 MiB / 4 KiB */
        .set PAGE_SHIFT,     12

        .set SYS_WRITE,      1
        .set SYS_EXIT_GROUP, 231
        .set SYS_YIELD,      0x40000000

        .set IO_PORT,        0xE0
        .set YMM_OFF,        256

/* (defined before use so hello_len is a known constant) */
/* ------------------------------------------------------------------------ */
        .section .rodata
hello_msg:
        .ascii  "hello from the guest\n"
        .set hello_len, . - hello_msg

/* ------------------------------------------------------------------------ */
        .text
        .globl _start
        .type _start, @function
_start:
        /* "ready": yield(0) before reading the mailbox. */
        xor     edi, edi
        mov     eax, SYS_YIELD
        syscall

main_loop:
        mov     rbx, qword ptr [mailbox + MAILBOX_CMD]   /* rbx = cmd = yield value */
        cmp     rbx, 1
        je      cmd_fill
        cmp     rbx, 2
        je      cmd_sum
        cmp     rbx, 3
        je      cmd_spin
        cmp     rbx, 4
        je      cmd_loadregs
        cmp     rbx, 5
        je      cmd_write
        cmp     rbx, 6
        je      cmd_write_err
        cmp     rbx, 7
        je      cmd_fault
        cmp     rbx, 8
        je      cmd_exit
        cmp     rbx, 9
        je      cmd_syscall
        cmp     rbx, 10
        je      cmd_hello
        /* fallthrough: unknown command */

cmd_bad:
        mov     rax, -1
        /* fallthrough */

/* rax = result, rbx = value to yield. */
finish:
        mov     qword ptr [mailbox + MAILBOX_RESULT], rax
        mov     rdi, rbx
        mov     eax, SYS_YIELD
        syscall                         /* clobbers rcx, r11; rax = 0 on resume */
        jmp     main_loop

/* Page-range check shared by FILL/SUM: rcx = count (arg0), rdx = first page
 * (arg2).  Jumps to cmd_bad unless arg2 <= HEAP_PAGES && arg0 <= HEAP_PAGES -
 * arg2.  On success rdi = heap + arg2*4096.  Implemented as a macro (no
 * call/ret, so the stack is never touched). */
.macro PAGE_RANGE_CHECK
        mov     rcx, qword ptr [mailbox + MAILBOX_ARG0]
        mov     rdx, qword ptr [mailbox + MAILBOX_ARG2]
        mov     eax, HEAP_PAGES
        cmp     rdx, rax
        ja      cmd_bad
        sub     rax, rdx
        cmp     rcx, rax
        ja      cmd_bad
        mov     rdi, rdx
        shl     rdi, PAGE_SHIFT
        add     rdi, offset heap
.endm

/* 1: FILL */
cmd_fill:
        PAGE_RANGE_CHECK
        mov     r8, qword ptr [mailbox + MAILBOX_ARG1]
        test    rcx, rcx
        jz      2f
1:
        mov     byte ptr [rdi], r8b
        add     rdi, 4096
        dec     rcx
        jnz     1b
2:
        mov     rax, qword ptr [mailbox + MAILBOX_ARG0]
        jmp     finish

/* 2: SUM */
cmd_sum:
        PAGE_RANGE_CHECK
        xor     eax, eax
        test    rcx, rcx
        jz      2f
1:
        movzx   edx, byte ptr [rdi]
        add     rax, rdx
        add     rdi, 4096
        dec     rcx
        jnz     1b
2:
        jmp     finish

/* 3: SPIN */
cmd_spin:
        jmp     cmd_spin

/* 4: LOADREGS */
cmd_loadregs:
        vmovdqu ymm0,  ymmword ptr [regs_in + YMM_OFF + 0*32]
        vmovdqu ymm1,  ymmword ptr [regs_in + YMM_OFF + 1*32]
        vmovdqu ymm2,  ymmword ptr [regs_in + YMM_OFF + 2*32]
        vmovdqu ymm3,  ymmword ptr [regs_in + YMM_OFF + 3*32]
        vmovdqu ymm4,  ymmword ptr [regs_in + YMM_OFF + 4*32]
        vmovdqu ymm5,  ymmword ptr [regs_in + YMM_OFF + 5*32]
        vmovdqu ymm6,  ymmword ptr [regs_in + YMM_OFF + 6*32]
        vmovdqu ymm7,  ymmword ptr [regs_in + YMM_OFF + 7*32]
        vmovdqu ymm8,  ymmword ptr [regs_in + YMM_OFF + 8*32]
        vmovdqu ymm9,  ymmword ptr [regs_in + YMM_OFF + 9*32]
        vmovdqu ymm10, ymmword ptr [regs_in + YMM_OFF + 10*32]
        vmovdqu ymm11, ymmword ptr [regs_in + YMM_OFF + 11*32]
        vmovdqu ymm12, ymmword ptr [regs_in + YMM_OFF + 12*32]
        vmovdqu ymm13, ymmword ptr [regs_in + YMM_OFF + 13*32]
        vmovdqu ymm14, ymmword ptr [regs_in + YMM_OFF + 14*32]
        vmovdqu ymm15, ymmword ptr [regs_in + YMM_OFF + 15*32]

        /* Absolute (disp32) addressing: no base register needed. */
        mov     rax, qword ptr [regs_in + 0*8]
        mov     rbx, qword ptr [regs_in + 1*8]
        mov     rcx, qword ptr [regs_in + 2*8]
        mov     rdx, qword ptr [regs_in + 3*8]
        mov     rsi, qword ptr [regs_in + 4*8]
        mov     rdi, qword ptr [regs_in + 5*8]
        mov     rbp, qword ptr [regs_in + 6*8]
        mov     r8,  qword ptr [regs_in + 7*8]
        mov     r9,  qword ptr [regs_in + 8*8]
        mov     r10, qword ptr [regs_in + 9*8]
        mov     r11, qword ptr [regs_in + 10*8]
        mov     r12, qword ptr [regs_in + 11*8]
        mov     r13, qword ptr [regs_in + 12*8]
        mov     r14, qword ptr [regs_in + 13*8]
        mov     r15, qword ptr [regs_in + 14*8]

        /* Exit to the host: snapshot / fork / restore happen here. */
        out     IO_PORT, al

        /* Store everything before any syscall (syscall clobbers rcx/r11). */
        mov     qword ptr [regs_out + 0*8],  rax
        mov     qword ptr [regs_out + 1*8],  rbx
        mov     qword ptr [regs_out + 2*8],  rcx
        mov     qword ptr [regs_out + 3*8],  rdx
        mov     qword ptr [regs_out + 4*8],  rsi
        mov     qword ptr [regs_out + 5*8],  rdi
        mov     qword ptr [regs_out + 6*8],  rbp
        mov     qword ptr [regs_out + 7*8],  r8
        mov     qword ptr [regs_out + 8*8],  r9
        mov     qword ptr [regs_out + 9*8],  r10
        mov     qword ptr [regs_out + 10*8], r11
        mov     qword ptr [regs_out + 11*8], r12
        mov     qword ptr [regs_out + 12*8], r13
        mov     qword ptr [regs_out + 13*8], r14
        mov     qword ptr [regs_out + 14*8], r15
        mov     qword ptr [regs_out + 15*8], rsp
        pushfq                                  /* uses 8 bytes below rsp */
        pop     qword ptr [regs_out + 16*8]

        vmovdqu ymmword ptr [regs_out + YMM_OFF + 0*32],  ymm0
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 1*32],  ymm1
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 2*32],  ymm2
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 3*32],  ymm3
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 4*32],  ymm4
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 5*32],  ymm5
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 6*32],  ymm6
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 7*32],  ymm7
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 8*32],  ymm8
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 9*32],  ymm9
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 10*32], ymm10
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 11*32], ymm11
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 12*32], ymm12
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 13*32], ymm13
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 14*32], ymm14
        vmovdqu ymmword ptr [regs_out + YMM_OFF + 15*32], ymm15

        mov     eax, 4                  /* result = 4 */
        mov     ebx, 4                  /* yield(4) */
        jmp     finish

/* 5: WRITE, 6: WRITE_ERR.  edi = fd. */
cmd_write:
        mov     edi, 1
        jmp     do_write
cmd_write_err:
        mov     edi, 2
do_write:
        mov     rdx, qword ptr [mailbox + MAILBOX_ARG0]    /* len */
        mov     rsi, qword ptr [mailbox + MAILBOX_ARG2]    /* first page */
        mov     eax, HEAP_PAGES
        cmp     rsi, rax
        ja      cmd_bad
        sub     rax, rsi
        shl     rax, PAGE_SHIFT                             /* bytes left in heap */
        cmp     rdx, rax
        ja      cmd_bad
        shl     rsi, PAGE_SHIFT
        add     rsi, offset heap
        mov     eax, SYS_WRITE
        syscall
        jmp     finish

/* 7: FAULT */
cmd_fault:
        mov     rax, qword ptr [mailbox + MAILBOX_ARG0]
        cmp     rax, 0
        je      fault_ud2
        cmp     rax, 1
        je      fault_null_write
        cmp     rax, 2
        je      fault_kernel_jump
        cmp     rax, 3
        je      fault_int3
        cmp     rax, 4
        je      fault_div0
        jmp     cmd_bad
fault_ud2:
        ud2
        jmp     cmd_bad                 /* not reached if the engine reports the fault */
fault_null_write:
        xor     eax, eax
        mov     byte ptr [rax], 1       /* #PF, cr2 = 0 */
        jmp     cmd_bad
fault_kernel_jump:
        movabs  rax, 0xffffff8000000000
        jmp     rax                     /* #PF on the fetch (ring-0-only / unmapped) */
fault_int3:
        int3
        jmp     cmd_bad
fault_div0:
        xor     edx, edx
        xor     ecx, ecx
        mov     eax, 1
        div     rcx                     /* #DE */
        jmp     cmd_bad

/* 8: EXIT */
cmd_exit:
        mov     rdi, qword ptr [mailbox + MAILBOX_ARG0]
        mov     eax, SYS_EXIT_GROUP
        syscall
        ud2                             /* exit_group must not return */

/* 9: raw SYSCALL (UNKNOWN_SYSCALL) */
cmd_syscall:
        mov     rax, qword ptr [mailbox + MAILBOX_ARG0]
        mov     rdi, qword ptr [mailbox + MAILBOX_ARG1]
        mov     rsi, qword ptr [mailbox + MAILBOX_ARG2]
        xor     edx, edx
        xor     r10d, r10d
        xor     r8d, r8d
        xor     r9d, r9d
        syscall
        jmp     finish

/* 10: HELLO */
cmd_hello:
        mov     edi, 1
        mov     esi, offset hello_msg
        mov     edx, hello_len
        mov     eax, SYS_WRITE
        syscall
        jmp     finish

        .size _start, . - _start

/* ------------------------------------------------------------------------ */
        .data
        .balign 4096
        .globl mailbox
        .type mailbox, @object
mailbox:                                /* 0x600000 */
        .quad   0, 0, 0, 0, 0           /* cmd, arg0, arg1, arg2, result */
        .size mailbox, . - mailbox

        .balign 4096
        .globl regs_in
        .type regs_in, @object
regs_in:                                /* 0x601000 */
        .zero   4096
        .size regs_in, . - regs_in

        .globl regs_out
        .type regs_out, @object
regs_out:                               /* 0x602000 */
        .zero   4096
        .size regs_out, . - regs_out

/* ------------------------------------------------------------------------ */
        .bss
        .balign 4096
        .globl heap
        .type heap, @object
heap:                                   /* 0x1000000, 128 MiB */
        .zero   HEAP_PAGES * 4096
        .size heap, . - heap

        .section .note.GNU-stack, "", @progbits

# The guest's vDSO: see src/guestos/vdso.rs for the design. Offsets into the data page ([vvar]),
# which lies one page below the image:
	.set MODE, 0x00
	.set REAL_BASE, 0x08
	.set MONO_BASE, 0x10
	.set ELAPSED, 0x18
	.set QUANTUM, 0x20
	.set BUDGET, 0x28           # read by images made before LIMIT (they decrement it)
	.set LAST_REAL, 0x30
	.set LAST_MONO, 0x38
	.set LIMIT, 0x40

	.text
	.hidden vvar_page

# rdi = clock id. Out: rax = virtual ns, or CF set when the fast path cannot answer.
# Clobbers rcx, rdx, r8.
	.type tick, @function
tick:
	cmpq $1, vvar_page+MODE(%rip)
	jne 9f
	cmp $11, %edi
	ja 9f
	mov $0x0921, %r8d          # REALTIME ids 0 5 8 11, as bits
	bt %edi, %r8d
	jc 1f
	mov $0x02d2, %r8d          # MONOTONIC ids 1 4 6 7 9
	bt %edi, %r8d
	jnc 9f
	call take
	jc 9f
	mov %rax, vvar_page+LAST_MONO(%rip)
	add vvar_page+MONO_BASE(%rip), %rax
	clc
	ret
1:	call take
	jc 9f
	mov %rax, vvar_page+LAST_REAL(%rip)
	add vvar_page+REAL_BASE(%rip), %rax
	clc
	ret
9:	stc
	ret
	.size tick, .-tick

# One quantum off the clock: rax = the elapsed time after this read, or CF set when the read
# would pass LIMIT (the host's budget, as the elapsed time the reads may reach). The one write is
# the cmpxchg, which is the read: the VMM may stop the vCPU between any two instructions and
# write the page again (guestos::vdso::publish), and a read is then either wholly before that
# or wholly after it. (A decrement of a budget word before the clock's own add left a read half
# made there: the VMM's next publish gave the budget back, and the thread switch came one read
# late.) If another thread's reads moved the clock meanwhile, the cmpxchg fails and the check
# is made again. Clobbers rcx, rdx.
	.type take, @function
take:
	mov vvar_page+QUANTUM(%rip), %rcx
	mov vvar_page+ELAPSED(%rip), %rax
1:	lea (%rax,%rcx), %rdx
	cmp vvar_page+LIMIT(%rip), %rdx
	ja 9f
	cmpxchg %rdx, vvar_page+ELAPSED(%rip)
	jne 1b
	mov %rdx, %rax
	clc
	ret
9:	stc
	ret
	.size take, .-take

	.globl __vdso_clock_gettime
	.type __vdso_clock_gettime, @function
__vdso_clock_gettime:
	call tick
	jc 8f
	xor %edx, %edx
	mov $1000000000, %ecx
	div %rcx
	mov %rax, (%rsi)
	mov %rdx, 8(%rsi)
	xor %eax, %eax
	ret
8:	mov $228, %eax
	syscall
	ret
	.size __vdso_clock_gettime, .-__vdso_clock_gettime

	.globl __vdso_gettimeofday
	.type __vdso_gettimeofday, @function
__vdso_gettimeofday:
	push %rdi
	xor %edi, %edi
	call tick
	pop %rdi
	jc 8f
	xor %edx, %edx
	mov $1000000000, %ecx
	div %rcx
	test %rdi, %rdi
	jz 1f
	mov %rax, (%rdi)
	mov %rdx, %rax
	xor %edx, %edx
	mov $1000, %ecx
	div %rcx
	mov %rax, 8(%rdi)
1:	test %rsi, %rsi
	jz 2f
	movq $0, (%rsi)
2:	xor %eax, %eax
	ret
8:	mov $96, %eax
	syscall
	ret
	.size __vdso_gettimeofday, .-__vdso_gettimeofday

	.globl __vdso_time
	.type __vdso_time, @function
__vdso_time:
	push %rdi
	xor %edi, %edi
	call tick
	pop %rdi
	jc 8f
	xor %edx, %edx
	mov $1000000000, %ecx
	div %rcx
	test %rdi, %rdi
	jz 1f
	mov %rax, (%rdi)
1:	ret
8:	mov $201, %eax
	syscall
	ret
	.size __vdso_time, .-__vdso_time

# Replay mode: fixed resolutions (as the syscall answers), no clock read.
	.globl __vdso_clock_getres
	.type __vdso_clock_getres, @function
__vdso_clock_getres:
	cmpq $1, vvar_page+MODE(%rip)
	jne 8f
	cmp $11, %edi
	ja 8f
	mov $0x0bf3, %r8d          # REALTIME and MONOTONIC ids
	bt %edi, %r8d
	jnc 8f
	test %rsi, %rsi
	jz 2f
	mov $1, %eax
	mov $4000000, %ecx
	cmp $5, %edi
	cmove %ecx, %eax
	cmp $6, %edi
	cmove %ecx, %eax
	movq $0, (%rsi)
	mov %rax, 8(%rsi)
2:	xor %eax, %eax
	ret
8:	mov $229, %eax
	syscall
	ret
	.size __vdso_clock_getres, .-__vdso_clock_getres


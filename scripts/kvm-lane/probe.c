// What a KVM does at an I/O exit: is RIP at the `out` or past it, and does a KVM_RUN with
// immediate_exit = 1 move it past (the KVM API's way to complete the instruction without running
// the guest further)? Real mode, one page: `out 0xe0, al` at 0x1000, then `hlt`.
// Exit status 0 when RIP is past the `out` after that run, whichever way the host behaves.
#include <errno.h>
#include <fcntl.h>
#include <linux/kvm.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>

static int fail(const char *what) { perror(what); return 2; }

int main(void) {
    int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
    if (kvm < 0) return fail("open /dev/kvm");
    int vm = ioctl(kvm, KVM_CREATE_VM, 0);
    if (vm < 0) return fail("KVM_CREATE_VM");
    unsigned char *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    const unsigned char code[] = {0xe6, 0xe0, 0xf4};  // out 0xe0, al; hlt
    memcpy(page, code, sizeof code);
    struct kvm_userspace_memory_region slot = {
        .slot = 0, .guest_phys_addr = 0x1000, .memory_size = 4096, .userspace_addr = (unsigned long)page};
    if (ioctl(vm, KVM_SET_USER_MEMORY_REGION, &slot) < 0) return fail("KVM_SET_USER_MEMORY_REGION");
    int cpu = ioctl(vm, KVM_CREATE_VCPU, 0);
    if (cpu < 0) return fail("KVM_CREATE_VCPU");
    struct kvm_run *run = mmap(NULL, ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0), PROT_READ | PROT_WRITE, MAP_SHARED, cpu, 0);
    struct kvm_sregs sregs;
    if (ioctl(cpu, KVM_GET_SREGS, &sregs) < 0) return fail("KVM_GET_SREGS");
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    if (ioctl(cpu, KVM_SET_SREGS, &sregs) < 0) return fail("KVM_SET_SREGS");
    struct kvm_regs regs = {.rip = 0x1000, .rflags = 2, .rax = 0x5a};
    if (ioctl(cpu, KVM_SET_REGS, &regs) < 0) return fail("KVM_SET_REGS");
    if (ioctl(cpu, KVM_RUN, 0) < 0) return fail("KVM_RUN");
    if (run->exit_reason != KVM_EXIT_IO) { fprintf(stderr, "exit reason %u, not KVM_EXIT_IO\n", run->exit_reason); return 2; }
    ioctl(cpu, KVM_GET_REGS, &regs);
    printf("probe: at KVM_EXIT_IO RIP is %s the out (0x%llx)\n", regs.rip == 0x1000 ? "AT" : "PAST", regs.rip);
    run->immediate_exit = 1;
    int r = ioctl(cpu, KVM_RUN, 0);
    int err = errno;
    run->immediate_exit = 0;
    ioctl(cpu, KVM_GET_REGS, &regs);
    printf("probe: after KVM_RUN with immediate_exit=1 (%s) RIP is 0x%llx\n", r < 0 ? strerror(err) : "entered the guest", regs.rip);
    return regs.rip == 0x1002 ? 0 : 1;
}

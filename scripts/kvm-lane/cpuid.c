/* A bare guest (no kernel, the engine's own syscall set) that prints what CPUID tells a program:
 * leaf 0 (vendor), leaf 1 (family/model/stepping in EAX; features in ECX/EDX), leaf 7 (EBX/ECX/EDX)
 * and 0x80000001 (ECX/EDX), then yields (the point a template is baked at), then prints them
 * again (what a clone of that template sees) and exits. Built by cpu_models.sh:
 *   gcc -O2 -static -nostdlib -fno-pie -no-pie -fno-stack-protector -o cpuid cpuid.c */
#define SYS_WRITE 1
#define SYS_EXIT 60
#define SYS_YIELD 0x40000000L

char stack[1 << 16] __attribute__((aligned(16)));
__asm__(".globl _start\n_start:\n lea stack+65536(%rip), %rsp\n call main\n hlt\n");

static long sys3(long n, long a, long b, long c) {
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return r;
}

static void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

static char buf[512];
static int len;

static void put(const char *s) {
    while (*s) buf[len++] = *s++;
}

static void hex(unsigned v) {
    for (int i = 28; i >= 0; i -= 4) buf[len++] = "0123456789abcdef"[(v >> i) & 15];
}

static void report(const char *when) {
    unsigned r[4];
    len = 0;
    put(when);
    cpuid(0, 0, r);
    put(" vendor=");
    for (int i = 0; i < 4; i++) buf[len++] = (char)(r[1] >> (8 * i));
    for (int i = 0; i < 4; i++) buf[len++] = (char)(r[3] >> (8 * i));
    for (int i = 0; i < 4; i++) buf[len++] = (char)(r[2] >> (8 * i));
    cpuid(1, 0, r);
    put(" leaf1.eax="); hex(r[0]); put(" leaf1.ecx="); hex(r[2] & ~(1u << 27)); /* OSXSAVE follows CR4 */
    put(" leaf1.edx="); hex(r[3]);
    cpuid(7, 0, r);
    put(" leaf7.ebx="); hex(r[1]); put(" leaf7.ecx="); hex(r[2]); put(" leaf7.edx="); hex(r[3]);
    cpuid(0x80000001u, 0, r);
    put(" ext1.ecx="); hex(r[2]); put(" ext1.edx="); hex(r[3]);
    put("\n");
    sys3(SYS_WRITE, 1, (long)buf, len);
}

int main(void) {
    report("boot");
    sys3(SYS_YIELD, 1, 0, 0);
    report("clone");
    sys3(SYS_EXIT, 0, 0, 0);
    for (;;) {
    }
}

//! Unmodified Linux programs under KVM (needs /dev/kvm and gcc): the ELF loader, the initial stack,
//! the memory syscalls and the miscellaneous ones, exercised by C programs compiled at test time
//! against the host's glibc. Each program checks its own results and exits with the number of the
//! first check that failed (0 when all passed).

mod common;

use common::launcher;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use collimate_engine::{RunExit, RunResult, SpawnSpec, Vm, VmConfig};

const T: Duration = Duration::from_secs(30);

/// A fresh sandbox root directory.
fn sandbox(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("linux-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compile `src` with the host gcc into `root/<name>`. False (the test skips) without gcc.
fn compile(root: &Path, name: &str, src: &str, flags: &[&str]) -> bool {
    let c = root.join(format!("{name}.c"));
    std::fs::write(&c, src).unwrap();
    match Command::new("gcc").args(["-O1", "-Wall"]).args(flags).arg("-o").arg(root.join(name)).arg(&c).status() {
        Ok(s) => {
            assert!(s.success(), "gcc failed for {name}");
            true
        }
        Err(_) => {
            eprintln!("gcc not found: skipping");
            false
        }
    }
}

fn spec(root: &Path, argv: &[&str], envp: &[&str]) -> SpawnSpec {
    SpawnSpec {
        root: root.to_path_buf(),
        mounts: vec![],
        argv: argv.iter().map(|s| s.as_bytes().to_vec()).collect(),
        envp: envp.iter().map(|s| s.as_bytes().to_vec()).collect(),
        cwd: "/".into(),
        ..Default::default()
    }
}

fn run(root: &Path, argv: &[&str], envp: &[&str]) -> RunResult {
    let mut vm = Vm::spawn(&launcher(), &spec(root, argv, envp), &VmConfig::default()).unwrap();
    vm.run(T).unwrap()
}

fn exited(r: &RunResult) -> i32 {
    match r.exit {
        RunExit::Exited { code } => code,
        other => panic!("did not exit: {other:?}; stderr {:?}", String::from_utf8_lossy(&r.stderr)),
    }
}

const HELLO: &str = r#"
#include <unistd.h>
int main(void) { write(1, "hello\n", 6); return 0; }
"#;

#[test]
fn static_hello() {
    let root = sandbox("hello");
    if !compile(&root, "hello", HELLO, &["-static"]) {
        return;
    }
    let r = run(&root, &["/hello"], &[]);
    assert_eq!(exited(&r), 0);
    assert_eq!(r.stdout, b"hello\n");
}

#[test]
fn static_pie_hello() {
    let root = sandbox("pie");
    if !compile(&root, "hello", HELLO, &["-static-pie"]) {
        return;
    }
    let r = run(&root, &["/hello"], &[]);
    assert_eq!(exited(&r), 0);
    assert_eq!(r.stdout, b"hello\n");
}

/// The process environment glibc sees: argv, envp, auxv, TLS, identity, clocks, randomness, limits.
const ENVIRONMENT: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sched.h>
#include <signal.h>
#include <sys/auxv.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/utsname.h>
#define CHECK(n, c) do { if (!(c)) return n; } while (0)
static __thread int tls_var = 42;
int main(int argc, char **argv) {
    CHECK(1, argc == 3 && strcmp(argv[1], "a b") == 0 && strcmp(argv[2], "") == 0);
    CHECK(2, getenv("X") && strcmp(getenv("X"), "y") == 0 && getenv("NOPE") == NULL);
    CHECK(3, getauxval(AT_PAGESZ) == 4096 && getauxval(AT_RANDOM) != 0 && getauxval(AT_SECURE) == 0);
    CHECK(4, strcmp((char *)getauxval(AT_PLATFORM), "x86_64") == 0);
    CHECK(5, strcmp((char *)getauxval(AT_EXECFN), "/env") == 0);
    CHECK(6, tls_var == 42);
    errno = 0; CHECK(7, close(-1) == -1 && errno != 0);
    CHECK(8, getpid() == 1 && getppid() == 0 && getuid() == 0 && geteuid() == 0 && getgid() == 0);
    struct utsname u; CHECK(9, uname(&u) == 0 && strcmp(u.sysname, "Linux") == 0 && strcmp(u.machine, "x86_64") == 0);
    struct timespec a, b; CHECK(10, clock_gettime(CLOCK_MONOTONIC, &a) == 0);
    CHECK(11, clock_gettime(CLOCK_MONOTONIC, &b) == 0 && (b.tv_sec > a.tv_sec || (b.tv_sec == a.tv_sec && b.tv_nsec >= a.tv_nsec)));
    CHECK(12, time(NULL) > 1600000000);
    struct timeval tv; CHECK(13, gettimeofday(&tv, NULL) == 0 && tv.tv_usec < 1000000);
    CHECK(14, clock() != (clock_t)-1);
    unsigned char r1[32] = {0}, r2[32] = {0};
    CHECK(15, getrandom(r1, 32, 0) == 32 && getrandom(r2, 32, GRND_NONBLOCK) == 32 && memcmp(r1, r2, 32) != 0);
    struct rlimit rl; CHECK(16, getrlimit(RLIMIT_STACK, &rl) == 0 && rl.rlim_cur == 8 << 20);
    rl.rlim_cur = 1 << 20; CHECK(17, setrlimit(RLIMIT_STACK, &rl) == 0 && getrlimit(RLIMIT_STACK, &rl) == 0 && rl.rlim_cur == 1 << 20);
    cpu_set_t set; CHECK(18, sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) == 1);
    CHECK(19, sysconf(_SC_NPROCESSORS_ONLN) >= 1);
    char name[16] = {0}; CHECK(20, prctl(PR_SET_NAME, "worker") == 0 && prctl(PR_GET_NAME, name) == 0 && strcmp(name, "worker") == 0);
    struct sigaction sa = {0}, old; sa.sa_handler = SIG_IGN;
    CHECK(21, sigaction(SIGPIPE, &sa, NULL) == 0 && sigaction(SIGPIPE, NULL, &old) == 0 && old.sa_handler == SIG_IGN);
    sigset_t ss, os; sigemptyset(&ss); sigaddset(&ss, SIGUSR1);
    CHECK(22, sigprocmask(SIG_BLOCK, &ss, NULL) == 0 && sigprocmask(SIG_SETMASK, NULL, &os) == 0 && sigismember(&os, SIGUSR1));
    CHECK(23, umask(077) == 022 && umask(022) == 077);
    CHECK(24, sched_yield() == 0);
    struct timespec d = {0, 1000000}; CHECK(25, nanosleep(&d, NULL) == 0);
    struct rusage ru; CHECK(26, getrusage(RUSAGE_SELF, &ru) == 0);
    return 0;
}
"#;

#[test]
fn static_process_environment() {
    let root = sandbox("env");
    if !compile(&root, "env", ENVIRONMENT, &["-static"]) {
        return;
    }
    let r = run(&root, &["/env", "a b", ""], &["X=y", "PATH=/bin"]);
    assert_eq!(exited(&r), 0, "check {} failed", exited(&r));
}

/// Heavy use of malloc, mmap, munmap, mprotect, mremap, madvise and brk, with the results checked.
const MEMORY: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#define CHECK(n, c) do { if (!(c)) return n; } while (0)
#define MB (1 << 20)
#define PG 4096
static int run(void) {
    for (int round = 0; round < 3; round++) {
        char *ps[300];
        for (int i = 0; i < 300; i++) {
            size_t sz = (size_t)(i * 7919) % 20000 + 1;
            ps[i] = malloc(sz);
            CHECK(1, ps[i] != NULL);
            memset(ps[i], i, sz);
        }
        for (int i = 0; i < 300; i++) {
            size_t sz = (size_t)(i * 7919) % 20000 + 1;
            for (size_t j = 0; j < sz; j += 97) CHECK(2, ps[i][j] == (char)i);
            free(ps[i]);
        }
    }
    char *big = malloc(8 * MB);
    CHECK(3, big != NULL);
    memset(big, 0x5a, 8 * MB);
    big = realloc(big, 32 * MB);
    CHECK(4, big != NULL);
    CHECK(5, big[8 * MB - 1] == 0x5a && big[0] == 0x5a);
    memset(big + 8 * MB, 1, 24 * MB);
    free(big);

    char *m = mmap(NULL, MB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(6, m != MAP_FAILED);
    for (int i = 0; i < MB; i += PG) CHECK(7, m[i] == 0);
    memset(m, 7, MB);
    CHECK(8, munmap(m + 10 * PG, 5 * PG) == 0);
    char *h = mmap(m + 10 * PG, 5 * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    CHECK(9, h == m + 10 * PG);
    CHECK(10, h[0] == 0 && h[5 * PG - 1] == 0 && m[10 * PG - 1] == 7 && m[15 * PG] == 7);
    void *r = mmap(m, PG, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    CHECK(11, r == MAP_FAILED && errno == EEXIST);
    CHECK(12, mprotect(m, PG, PROT_READ) == 0);
    CHECK(13, m[0] == 7);
    CHECK(14, mprotect(m, PG, PROT_READ | PROT_WRITE) == 0);
    m[0] = 9;
    CHECK(15, m[0] == 9);
    char *n = mremap(m, MB, 4 * MB, MREMAP_MAYMOVE);
    CHECK(16, n != MAP_FAILED);
    CHECK(17, n[0] == 9 && n[MB - 1] == 7 && n[4 * MB - 1] == 0);
    CHECK(18, madvise(n, PG, MADV_DONTNEED) == 0);
    CHECK(19, n[0] == 0 && n[PG] == 7);
    CHECK(20, munmap(n, 4 * MB) == 0);

    char *res = mmap(NULL, 256 * MB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    CHECK(21, res != MAP_FAILED);
    CHECK(22, mprotect(res, MB, PROT_READ | PROT_WRITE) == 0);
    memset(res, 3, MB);
    CHECK(23, mprotect(res + MB, MB, PROT_READ | PROT_WRITE) == 0);
    CHECK(24, res[MB] == 0 && res[MB - 1] == 3);
    CHECK(25, munmap(res, 256 * MB) == 0);

    char *b0 = sbrk(0);
    CHECK(26, sbrk(MB) == b0);
    memset(b0, 4, MB);
    CHECK(27, sbrk(0) == b0 + MB);
    CHECK(28, sbrk(-(MB / 2)) == b0 + MB);
    CHECK(29, b0[MB / 2 - 1] == 4);

    for (int i = 0; i < 1000; i++) {
        char *p = mmap(NULL, 3 * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(30, p != MAP_FAILED);
        CHECK(31, p[0] == 0 && p[PG] == 0 && p[3 * PG - 1] == 0);
        memset(p, i | 1, 3 * PG);
        CHECK(32, munmap(p, 3 * PG) == 0);
    }
    CHECK(33, munmap((void *)0x10001, PG) == -1 && errno == EINVAL);
    CHECK(34, mprotect((void *)0x10000, PG, PROT_READ) == -1 && errno == ENOMEM);
    unsigned char vec[4];
    char *q = mmap(NULL, 4 * PG, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(35, mincore(q, 4 * PG, vec) == 0 && vec[0] == 1);
    CHECK(36, msync(q, PG, MS_SYNC) == 0);
    return 0;
}
int main(void) {
    int r = run();
    if (r == 0) write(1, "ok\n", 3);
    return r;
}
"#;

#[test]
fn static_memory_syscalls() {
    let root = sandbox("mem");
    if !compile(&root, "mem", MEMORY, &["-static"]) {
        return;
    }
    let r = run(&root, &["/mem"], &[]);
    assert_eq!(exited(&r), 0, "check {} failed", exited(&r));
}

/// Touch a page, take it away (munmap or mprotect), touch it again: the guest must fault, not keep
/// using a cached translation.
const TAKE_AWAY: &str = r#"
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <ucontext.h>
#include <sys/mman.h>
static void on_segv(int sig, siginfo_t *si, void *ctx) {
    ucontext_t *uc = ctx;
    printf("%x %lx %llx %llx\n", sig, (unsigned long)si->si_addr, uc->uc_mcontext.gregs[REG_ERR], uc->uc_mcontext.gregs[REG_TRAPNO]);
    fflush(stdout);
    _exit(0);
}
int main(int argc, char **argv) {
    if (argc > 2) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_segv;
        sa.sa_flags = SA_SIGINFO;
        sigaction(SIGSEGV, &sa, NULL);
    }
    volatile char *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 1;
    p[0] = 1;
    if (strcmp(argv[1], "munmap") == 0) {
        if (munmap((void *)p, 4096) != 0) return 2;
        return p[0] + 10;
    }
    if (mprotect((void *)p, 4096, PROT_READ) != 0) return 3;
    p[0] = 2;
    return 4;
}
"#;

#[test]
fn taken_away_pages_fault() {
    let root = sandbox("takeaway");
    if !compile(&root, "t", TAKE_AWAY, &["-static"]) {
        return;
    }
    for how in ["munmap", "mprotect"] {
        // Without a handler the process dies by SIGSEGV.
        let r = run(&root, &["/t", how], &[]);
        assert_eq!(r.exit, RunExit::Signaled { signo: 11 }, "{how}: expected a page fault");
        // With one, the handler sees the fault: address, error code and vector.
        let r = run(&root, &["/t", how, "handler"], &[]);
        assert_eq!(exited(&r), 0, "{how}");
        let out = String::from_utf8_lossy(&r.stdout).into_owned();
        let f: Vec<u64> = out.split_whitespace().map(|w| u64::from_str_radix(w, 16).unwrap()).collect();
        let (sig, cr2, error_code, trapno) = (f[0], f[1], f[2], f[3]);
        assert_eq!((sig, trapno), (11, 14), "{how}: {out}");
        assert!(cr2 > 0x7000_0000_0000, "{how}: cr2 {cr2:#x}");
        // User mode; a write after mprotect is a protection fault on a present page.
        assert_ne!(error_code & 4, 0);
        if how == "mprotect" {
            assert_eq!(error_code & 3, 3, "present + write");
        }
    }
}

const SLEEPER: &str = r#"
#include <time.h>
int main(void) {
    struct timespec d = {3, 0};
    return nanosleep(&d, NULL) == 0 ? 0 : 1;
}
"#;

#[test]
fn a_long_sleep_honours_the_run_budget_and_resumes() {
    let root = sandbox("sleep");
    if !compile(&root, "sleep", SLEEPER, &["-static"]) {
        return;
    }
    let mut vm = Vm::spawn(&launcher(), &spec(&root, &["/sleep"], &[]), &VmConfig::default()).unwrap();
    let start = std::time::Instant::now();
    let r = vm.run(Duration::from_millis(200)).unwrap();
    assert_eq!(r.exit, RunExit::Timeout, "the sleep outlasts the budget");
    // Well under the 3 s sleep, with room for a loaded host.
    assert!(r.duration < Duration::from_millis(1500), "{:?}", r.duration);
    let r = vm.run(T).unwrap();
    assert_eq!(exited(&r), 0);
    let total = start.elapsed();
    assert!(total >= Duration::from_millis(3000), "slept only {total:?}");
    assert!(total < Duration::from_millis(10000), "{total:?}");
}

const DYNAMIC: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(int argc, char **argv) {
    char *p = malloc(100000);
    if (!p) return 1;
    memset(p, 1, 100000);
    printf("dynamic %s %d\n", argv[1], p[99999]);
    free(p);
    return 0;
}
"#;

/// Copy a host library (following symlinks) to the same path under `root`.
fn copy_lib(root: &Path, host: &str) {
    let dst = root.join(host.trim_start_matches('/'));
    std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
    std::fs::copy(host, &dst).unwrap();
}

#[test]
fn dynamic_hello() {
    let root = sandbox("dyn");
    if !compile(&root, "dyn", DYNAMIC, &[]) {
        return;
    }
    copy_lib(&root, "/lib64/ld-linux-x86-64.so.2");
    copy_lib(&root, "/lib/x86_64-linux-gnu/libc.so.6");
    let r = run(&root, &["/dyn", "world"], &[]);
    assert_eq!(exited(&r), 0, "stderr {:?}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(r.stdout, b"dynamic world 1\n");
    assert_eq!(r.enosys, 0, "unserviced syscalls");
}

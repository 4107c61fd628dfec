//! The stack dump of `PRISM_STACKS_ON_SIGQUIT=1` (the `prism` binary and the device checks install it):
//! `kill -QUIT PID` makes every thread of the process write its call stack to stderr, then the
//! process's memory map, and the process carries on.
//!
//! This is for hangs on machines without a debugger. The GPU machines have no gdb, and `cuda-gdb`'s
//! attach hung there on a stalled load (docs/optimization-log.md, history: the eighth session). The output is raw return
//! addresses, one line a thread, between `prism-stacks begin` and `prism-stacks end`:
//!
//! ```text
//! prism-stack tid=1234 name=prism-load-3 frames: 0x55d0c2a1b2c3 0x55d0c2a1b000 …
//! ```
//!
//! To symbolize an address A inside the `prism` binary (a position-independent executable), take BASE,
//! the start of its first mapping (file offset 0) in the map that follows, and run
//! `addr2line -f -C -i -e prism (A − 1 − BASE)` on an unstripped build of the same commit (the − 1
//! points into the call instruction).
//!
//! The handlers only make system calls (`write`, `open`, `read`, `getdents64`, `tgkill`, `prctl`,
//! `nanosleep`, `close`) and walk their own stack with the unwinder. They format into buffers on
//! their own stack and allocate nothing, so they are safe to run whatever the interrupted thread was
//! doing, the allocator included. The unwinder is not formally async-signal-safe, but the binary links
//! it statically (no `dlopen` on first use), which is what crash reporters rely on too.

/// Installs the SIGQUIT dump for the rest of the process (the `prism` binary and the device checks do
/// when `PRISM_STACKS_ON_SIGQUIT` is set). Linux only: elsewhere an error.
pub fn install() -> std::io::Result<()> {
    imp::install()
}

#[cfg(target_os = "linux")]
mod imp {
    use std::ffi::{c_int, c_void};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// Return addresses a thread reports at most.
    const MAX_FRAMES: usize = 96;
    /// How long the dumping thread waits for each other thread's line.
    const WAIT_PER_THREAD_MS: u64 = 200;

    /// Set while a dump runs: a second SIGQUIT meanwhile is ignored.
    static DUMPING: AtomicBool = AtomicBool::new(false);
    /// Lines written by [`dump_this_thread`] so far: the dumping thread waits for it to move.
    static LINES: AtomicUsize = AtomicUsize::new(0);

    // The unwinder's C interface (libgcc_s / libunwind, linked by Rust's standard library).
    type TraceFn = extern "C" fn(ctx: *mut c_void, arg: *mut c_void) -> c_int;
    extern "C" {
        fn _Unwind_Backtrace(trace: TraceFn, arg: *mut c_void) -> c_int;
        fn _Unwind_GetIP(ctx: *mut c_void) -> usize;
    }

    const URC_NO_REASON: c_int = 0;
    const URC_NORMAL_STOP: c_int = 4;

    /// A fixed buffer of bytes on the stack.
    struct Line {
        bytes: [u8; 4096],
        len: usize,
    }

    impl Line {
        fn new() -> Self {
            Self {
                bytes: [0; 4096],
                len: 0,
            }
        }

        fn push(&mut self, s: &[u8]) {
            let room = self.bytes.len() - self.len;
            let n = s.len().min(room);
            self.bytes[self.len..self.len + n].copy_from_slice(&s[..n]);
            self.len += n;
        }

        fn push_dec(&mut self, mut v: u64) {
            let mut digits = [0u8; 20];
            let mut i = digits.len();
            loop {
                i -= 1;
                digits[i] = b'0' + (v % 10) as u8;
                v /= 10;
                if v == 0 {
                    break;
                }
            }
            self.push(&digits[i..]);
        }

        fn push_hex(&mut self, v: usize) {
            let mut digits = [0u8; 16];
            let mut i = digits.len();
            let mut v = v;
            loop {
                i -= 1;
                digits[i] = b"0123456789abcdef"[v & 15];
                v >>= 4;
                if v == 0 {
                    break;
                }
            }
            self.push(b"0x");
            self.push(&digits[i..]);
        }

        fn write_to_stderr(&self) {
            write_all(&self.bytes[..self.len]);
        }
    }

    fn write_all(mut bytes: &[u8]) {
        while !bytes.is_empty() {
            // SAFETY: `bytes` is a valid buffer of that length.
            let n = unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
            if n <= 0 {
                let interrupted =
                    n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR);
                if interrupted {
                    continue;
                }
                return;
            }
            bytes = &bytes[n as usize..];
        }
    }

    fn gettid() -> u64 {
        // SAFETY: gettid takes no arguments and cannot fail.
        unsafe { libc::syscall(libc::SYS_gettid) as u64 }
    }

    struct Frames {
        ips: [usize; MAX_FRAMES],
        len: usize,
    }

    extern "C" fn collect(ctx: *mut c_void, arg: *mut c_void) -> c_int {
        // SAFETY: `arg` is the `Frames` that `dump_this_thread` passed to `_Unwind_Backtrace`, and
        // `ctx` the unwinder's own context for this frame.
        let frames = unsafe { &mut *arg.cast::<Frames>() };
        let ip = unsafe { _Unwind_GetIP(ctx) };
        if ip == 0 || frames.len == MAX_FRAMES {
            return URC_NORMAL_STOP;
        }
        frames.ips[frames.len] = ip;
        frames.len += 1;
        URC_NO_REASON
    }

    /// SIGUSR2: this thread's line.
    extern "C" fn dump_this_thread(_signal: c_int) {
        let saved_errno = std::io::Error::last_os_error().raw_os_error();
        let mut frames = Frames {
            ips: [0; MAX_FRAMES],
            len: 0,
        };
        // SAFETY: `collect` only writes into `frames`, which outlives the call.
        unsafe { _Unwind_Backtrace(collect, (&mut frames as *mut Frames).cast()) };
        let mut name = [0u8; 17];
        // SAFETY: PR_GET_NAME writes at most 16 bytes and a NUL into the buffer.
        unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
        let name_len = name.iter().position(|&b| b == 0).unwrap_or(16);
        let mut line = Line::new();
        line.push(b"prism-stack tid=");
        line.push_dec(gettid());
        line.push(b" name=");
        line.push(&name[..name_len]);
        line.push(b" frames:");
        for &ip in &frames.ips[..frames.len] {
            line.push(b" ");
            line.push_hex(ip);
        }
        line.push(b"\n");
        line.write_to_stderr();
        LINES.fetch_add(1, Ordering::SeqCst);
        if let Some(errno) = saved_errno {
            // SAFETY: errno is thread-local; restoring it keeps the interrupted code's view.
            unsafe { *libc::__errno_location() = errno };
        }
    }

    fn sleep_ms(ms: u64) {
        let t = libc::timespec {
            tv_sec: 0,
            tv_nsec: (ms * 1_000_000) as libc::c_long,
        };
        // SAFETY: a valid timespec; an early wake-up only shortens the wait.
        unsafe { libc::nanosleep(&t, std::ptr::null_mut()) };
    }

    /// Copies the file at `path` (NUL-terminated) to stderr.
    fn copy_file(path: &[u8]) {
        // SAFETY: `path` is NUL-terminated; the descriptor is closed below.
        let fd = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return;
        }
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: reads into a buffer of that length.
            let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
            write_all(&buf[..n as usize]);
        }
        // SAFETY: `fd` was opened above.
        unsafe { libc::close(fd) };
    }

    /// Signals every other thread of the process to write its line, one at a time.
    fn signal_other_threads(pid: libc::pid_t, own: u64) {
        // SAFETY: a NUL-terminated path; the descriptor is closed below.
        let fd = unsafe {
            libc::open(
                c"/proc/self/task".as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return;
        }
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: getdents64 fills at most `buf.len()` bytes of linux_dirent64 records.
            let n = unsafe { libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), buf.len()) };
            if n <= 0 {
                break;
            }
            let mut at = 0usize;
            while at + 19 <= n as usize {
                // linux_dirent64: d_ino u64, d_off i64, d_reclen u16, d_type u8, d_name (NUL-ended).
                let reclen = u16::from_ne_bytes([buf[at + 16], buf[at + 17]]) as usize;
                if reclen == 0 || at + reclen > n as usize {
                    break;
                }
                let name = &buf[at + 19..at + reclen];
                let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
                at += reclen;
                let mut tid = 0u64;
                let numeric = !name.is_empty() && name.iter().all(|b| b.is_ascii_digit());
                if !numeric {
                    continue;
                }
                for &b in name {
                    tid = tid * 10 + u64::from(b - b'0');
                }
                if tid == own {
                    continue;
                }
                let before = LINES.load(Ordering::SeqCst);
                // SAFETY: tgkill to a thread of this process; a thread that has exited meanwhile
                // makes it fail with ESRCH, which is fine.
                let sent = unsafe {
                    libc::syscall(libc::SYS_tgkill, pid, tid as libc::pid_t, libc::SIGUSR2)
                };
                if sent != 0 {
                    continue;
                }
                for _ in 0..WAIT_PER_THREAD_MS {
                    if LINES.load(Ordering::SeqCst) != before {
                        break;
                    }
                    sleep_ms(1);
                }
            }
        }
        // SAFETY: `fd` was opened above.
        unsafe { libc::close(fd) };
    }

    /// SIGQUIT: the whole dump.
    extern "C" fn dump_all(_signal: c_int) {
        if DUMPING.swap(true, Ordering::SeqCst) {
            return;
        }
        let saved_errno = std::io::Error::last_os_error().raw_os_error();
        // SAFETY: getpid cannot fail.
        let pid = unsafe { libc::getpid() };
        let mut line = Line::new();
        line.push(b"prism-stacks begin pid=");
        line.push_dec(pid as u64);
        line.push(b" (kill -QUIT; ");
        line.push(b"PRISM_STACKS_ON_SIGQUIT");
        line.push(b")\n");
        line.write_to_stderr();
        dump_this_thread(0);
        signal_other_threads(pid, gettid());
        write_all(b"prism-stacks maps\n");
        copy_file(b"/proc/self/maps\0");
        write_all(b"prism-stacks end\n");
        if let Some(errno) = saved_errno {
            // SAFETY: errno is thread-local.
            unsafe { *libc::__errno_location() = errno };
        }
        DUMPING.store(false, Ordering::SeqCst);
    }

    fn set_handler(signal: c_int, handler: extern "C" fn(c_int)) -> std::io::Result<()> {
        // SAFETY: a zeroed sigaction is a valid starting point; the handler is a plain function
        // that only does what the module's header allows.
        let result = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = handler as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if result != 0 {
            let error = std::io::Error::last_os_error();
            return Err(std::io::Error::new(
                error.kind(),
                format!("could not install the handler for signal {signal}: {error}"),
            ));
        }
        Ok(())
    }

    pub fn install() -> std::io::Result<()> {
        set_handler(libc::SIGUSR2, dump_this_thread)?;
        set_handler(libc::SIGQUIT, dump_all)
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    pub fn install() -> std::io::Result<()> {
        Err(std::io::Error::other(
            "the stack dump on SIGQUIT is only supported on Linux",
        ))
    }
}
